"""A whole federation on one machine, through the same parts as production:
a private Mosquitto with generated credentials and ACL, one agent *process*
per device reading its own data, and the coordinator's round loop.

The devices' data is either a built-in dataset cut into shards (`dataset`,
`partition`), or the user's own: `devices_dir` holds one `<device>.toml` per
agent whose `[data]` section (the agent config's, edge_agent/config.py) names
that device's source, with the user's model (`model = "package.module:factory"`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.engine.loop import Engine, record_dict
from broker_coordinator.engine.private_rounds import BudgetSpent
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.reporting.report import (
    format_round,
    plot_accuracy,
    write_history,
)
from broker_coordinator.reporting.tracking import RunTracker
from broker_coordinator.settings import composition
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.settings.serving_settings import ServingSettings
from broker_coordinator.settings.tracking_settings import TrackingSettings
from broker_coordinator.simulation import fleet
from broker_coordinator.simulation.private_broker import PrivateBroker
from broker_coordinator.simulation.processes import stop_processes
from broker_coordinator.simulation.simulated_sites import SimulatedSites, deal
from broker_coordinator.storage.store import Store
from edgefl_protocol import signing
from edgefl_protocol.persist import atomic_write
from edgefl_protocol.settings import ConfigError, read_toml, to_toml
from edgefl_models import datasets, partition
from edgefl_models.objectives import Objective

log = logging.getLogger("broker_coordinator.simulation.simulate")
PROJECT_ROOT = Path(__file__).resolve().parent.parent
RUN_MARKER = ".edgefl-simulation"


@dataclass
class SimulationSpec:
    agents: int = 10
    rounds: int = 20
    dataset: str = "mnist5k"
    partition: str = "dirichlet:0.3"
    seed: int = 0
    out: Path = Path("demo-out")
    federation: str = "sim"
    broker_port: int = 0
    mosquitto: str | None = None
    agent_threads: int = 1
    startup_timeout: float = 180.0
    metrics_port: int = 0  # 0: no Prometheus endpoint
    partition_file: Path | None = None  # an .npz with train_idx and offsets (bench/data): overrides partition
    fleet: str | None = None  # e.g. "zero2w:4,pi3:4,pi4:8,pi5:4": per-agent CPU quota and memory limit (fleet.py)
    fleet_cpu: float = 0.0  # CPU cores of speed 1.0 (a Pi 5); 0 = fleet.default_cpu_scale
    churn: str | None = None  # "FRACTION[:SECONDS]": devices go offline and come back (fleet.py)
    model: str | None = None  # None: the dataset's model; else a built-in name or package.module:factory
    task: str = "classification"
    loss: str = ""
    devices_dir: Path | None = None  # the user's own devices: one <device>.toml with a [data] section each
    test_data: Path | None = None  # with devices_dir: the coordinator's test set (.npz); None = none
    holdout: float = 0.2  # the shards' held-out fraction when devices evaluate (built-in datasets)
    sites: int = 0  # > 0: the devices in this many bridged sites, each with its aggregator (simulated_sites)
    site_workers: int = 1  # aggregator workers per site
    tracking: TrackingSettings | None = None  # each round to TensorBoard / MLflow (reporting/tracking.py)
    serving: str = "off"  # [serving] publish: "served" or "last" fills each device's serving store as `run` does


def read_partition_file(path: Path, agents: int, train_size: int) -> list:
    """Client index lists from an .npz holding `train_idx` and `offsets` (client k owns
    train_idx[offsets[k]:offsets[k+1]]), e.g. bench/data/mnist5k_dir01_20clients.npz."""
    import numpy as np
    try:
        with np.load(path) as f:
            train_idx, offsets = f["train_idx"], f["offsets"]
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"partition file {path}: needs arrays train_idx and offsets ({exc})") from None
    if len(offsets) - 1 != agents:
        raise ValueError(f"partition file {path} has {len(offsets) - 1} clients but --agents is {agents}")
    if len(train_idx) and (train_idx.min() < 0 or train_idx.max() >= train_size):
        raise ValueError(f"partition file {path} indexes outside the {train_size} training samples")
    return [train_idx[offsets[k]:offsets[k + 1]] for k in range(agents)]


def prepare_shards(spec: SimulationSpec, data: datasets.FederatedData, devices_dir: Path) -> list[Path]:
    if spec.partition_file:
        parts = read_partition_file(spec.partition_file, spec.agents, len(data.train))
    else:
        parts = partition.split(spec.partition, data.train.y, spec.agents, spec.seed, data.natural_shards)
    paths = []
    for i, index in enumerate(parts):
        path = devices_dir / f"dev-{i:03d}" / "data.npz"
        datasets.save_npz(path, data.train.subset(index))
        paths.append(path)
    return paths


def read_devices_dir(directory: Path) -> dict[str, dict]:
    """device -> its [data] section, from DIR/<device>.toml (the user's own devices)."""
    files = sorted(directory.glob("*.toml")) if directory.is_dir() else []
    if not files:
        raise ConfigError(f"--devices-dir {directory}: no <device>.toml files (each with a [data] section)")
    devices = {}
    for path in files:
        raw = read_toml(path)
        if not isinstance(raw.get("data"), dict) or set(raw) - {"data"}:
            raise ConfigError(f"{path}: expected exactly one [data] section (keys: edge_agent/config.py)")
        devices[path.stem] = raw["data"]
    return devices


def write_agent_config(path: Path, device: str, password: str, port: int, spec: SimulationSpec,
                       data: Path | dict, signing_key: bytes | None = None) -> None:
    """The agent config format of edge_agent/config.py, as a device would have it after enrollment.
    `data`: a shard file (npz), or a whole [data] section."""
    sections = {
        "broker": {"host": "127.0.0.1", "port": port, "username": device, "password": password},
        "device": {"id": device, "state_dir": str(path.parent / "state"),
                   "federation": spec.federation, "threads": spec.agent_threads,
                   "signing_key": signing_key.hex() if signing_key else None},
    }
    if isinstance(data, dict):
        sections["data"] = data
    else:
        sections["device"]["data"] = str(data)
    atomic_write(path, to_toml(sections), 0o600)  # it holds the agent's broker password and signing key


def spawn_agent(config: Path, log_path: Path, cgroup_procs: list[Path] | None = None,
                append: bool = False) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "edge_agent", "run", "--config", str(config)]
    if cgroup_procs:
        argv = fleet.join_command(cgroup_procs, argv)  # joins its cgroups before exec: limited from the start
    with open(log_path, "ab" if append else "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def setup_fleet(spec: SimulationSpec, devices: list[str], run_name: str, echo) -> tuple[
        fleet.Cgroups | None, dict[str, list[Path]], dict[str, str]]:
    """Per-device cgroups for --fleet; without the rights, one line saying what is missing."""
    if not spec.fleet:
        return None, {}, {}
    classes = fleet.assign(spec.fleet, len(devices), spec.seed)
    names = {device: c.name for device, c in zip(devices, classes)}
    scale = spec.fleet_cpu or fleet.default_cpu_scale(classes)
    try:
        groups = fleet.Cgroups(run_name)
        procs = {device: groups.limit(device, c.speed * scale, c.memory_limit_mb)
                 for device, c in zip(devices, classes)}
    except fleet.CgroupUnavailable as exc:
        if "groups" in locals():
            groups.remove()
        echo(f"fleet emulation off: {exc}; agents run without CPU quota or memory limit")
        return None, {}, names
    summary = ", ".join(f"{n} x{sum(1 for c in classes if c.name == n)} "
                        f"({fleet.PROFILES[n].speed * scale:.2f} CPU, {fleet.PROFILES[n].memory_limit_mb} MB)"
                        for n in dict.fromkeys(c.name for c in classes))
    echo(f"fleet: {summary} (cgroup v{groups.version})")
    return groups, procs, names


def simulate(spec: SimulationSpec, settings: RoundSettings, echo=print, spawn=spawn_agent) -> list[dict]:
    """Run the federation; write history.json and accuracy.png into spec.out; return the rounds.

    `spawn(config, log_path)` starts one agent process (checks/pi/pi_check.py starts one under emulation)."""
    settings.validate()
    if spec.sites:
        composition.check(settings, "sites")
    objective = Objective.of(spec.task, spec.loss)
    own = read_devices_dir(spec.devices_dir) if spec.devices_dir else None
    data = None if own else datasets.load(spec.dataset, num_users=spec.agents, seed=spec.seed)
    test_set = (datasets.load_npz(spec.test_data, spec.task) if spec.test_data else None) if own else data.test
    central, on_devices = settings.evaluation(test_set is not None)
    model = spec.model or (data.model if data else None)
    if model is None:
        raise ConfigError("--devices-dir needs --model: a built-in name or package.module:factory")
    if own:
        spec.agents = len(own)
    out = spec.out
    run_dir = out / "run"
    if (run_dir / RUN_MARKER).exists():
        shutil.rmtree(run_dir)  # a simulation starts fresh; only a directory we made is removed
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_MARKER).write_text("created by broker-coordinator simulate; removed by the next run\n")
    devices_dir = run_dir / "devices"
    if own:
        device_data: list[Path | dict] = list(own.values())
        for device in own:
            (devices_dir / device).mkdir(parents=True, exist_ok=True)
        echo(f"{len(own)} devices with their own data ({', '.join(sorted({d.get('source', 'npz') for d in own.values()}))}), "
             f"model {model}, {objective.task} ({objective.metric}); "
             + (f"{len(test_set)} test samples on the coordinator" if test_set is not None
                else "no central test set: the devices evaluate on their held-out slices"))
    else:
        shards = prepare_shards(spec, data, devices_dir)
        # devices evaluate on a held-out slice of their shard only when asked to; else they train on all of it
        evaluating = on_devices or settings.eval_only_every > 0
        device_data = [{"source": "npz", "path": str(p), "holdout": spec.holdout} for p in shards] if evaluating \
            else list(shards)
        echo(f"{data.name}: {len(data.train)} training samples over {spec.agents} agents "
             f"({spec.partition_file or spec.partition}), "
             f"{len(data.test)} held out for the coordinator")

    devices = list(own) if own else [f"dev-{i:03d}" for i in range(spec.agents)]
    keys = {device: signing.new_key() for device in devices}  # per-device update signing keys
    processes: dict[str, subprocess.Popen] = {}
    history: list[dict] = []
    churn: fleet.Churn | None = None
    with contextlib.ExitStack() as running:
        metrics = Metrics()
        if spec.metrics_port:  # Prometheus' /metrics and the dashboard (/) on one port
            from broker_coordinator.engine.fleet_view import fleet_snapshot
            from edgefl_protocol.protocol import SPOKEN
            metrics.serve(spec.metrics_port, snapshot=lambda: fleet_snapshot(run_dir / "coordinator", spec.federation,
                                                                             SPOKEN))
            echo(f"the dashboard on http://127.0.0.1:{spec.metrics_port}/ and Prometheus metrics on "
                 f"http://127.0.0.1:{spec.metrics_port}/metrics")
        tracker = RunTracker.start(spec.tracking, spec.federation,
                                   {"simulation": {**vars(spec), "tracking": None}, "rounds": settings}, metrics)
        if tracker:  # a run that fails is closed as FAILED; one that finishes, below with its files
            running.push(lambda kind, exc, tb: tracker.finish(failed=True) if kind else None)
        cohort: set[str] = set()  # who the last round asked (for the fleet's late/offline accounting)
        common = dict(seed=spec.seed, store=Store(run_dir / "coordinator"), metrics=metrics,
                      on_state=lambda rnd: (cohort.clear(), cohort.update(rnd.cohort)), objective=objective,
                      serving=None if spec.serving == "off" else ServingSettings(publish=spec.serving))
        if spec.sites:
            sites = SimulatedSites(run_dir / "sites", spec.federation, model, deal(devices, spec.sites), keys,
                                   spec.site_workers)
            running.callback(sites.stop)
            sites.start()
            assert sites.rig is not None and sites.rig.central is not None
            passwords, port_of = sites.rig.passwords, sites.device_port
            if settings.privacy.on and not settings.privacy.population:  # the sites hold the devices' keys
                settings.privacy.population = len(devices)
            coordinator = Engine(spec.federation, model, test_set, settings, device_keys={},
                                 sites=sites.specs(), **common)
            running.callback(coordinator.close)
            coordinator.connect("127.0.0.1", sites.rig.central.port, COORDINATOR_USER,
                                sites.rig.coordinator_password)
            echo(f"{spec.sites} sites, each a mosquitto bridged to a central one on 127.0.0.1:"
                 f"{sites.rig.central.port} (no anonymous access, per-device ACL), {spec.site_workers} "
                 f"aggregator worker(s) a site")
        else:
            broker = PrivateBroker(run_dir / "broker", spec.federation, port=spec.broker_port,
                                   mosquitto=spec.mosquitto)
            coordinator_password = broker.add_user(COORDINATOR_USER)
            passwords = {device: broker.add_user(device) for device in devices}
            running.enter_context(broker)
            port_of = lambda device: broker.port  # noqa: E731
            echo(f"mosquitto listening on 127.0.0.1:{broker.port} (no anonymous access, per-device ACL)")
            coordinator = Engine(spec.federation, model, test_set, settings, device_keys=keys, **common)
            running.callback(coordinator.close)
            coordinator.connect("127.0.0.1", broker.port, COORDINATOR_USER, coordinator_password)
        groups, cgroup_procs, classes = setup_fleet(spec, devices, f"edgefl-{spec.federation}-{os.getpid()}", echo)

        def start(device: str, again: bool = False) -> subprocess.Popen:
            home = devices_dir / device
            if spawn is not spawn_agent:  # a caller's own launcher (checks/pi/pi_check.py: one agent emulated)
                return spawn(home / "agent.toml", home / "agent.log")
            return spawn_agent(home / "agent.toml", home / "agent.log", cgroup_procs.get(device), append=again)

        try:
            for device, local in zip(devices, device_data):
                write_agent_config(devices_dir / device / "agent.toml", device, passwords[device], port_of(device),
                                   spec, local, keys[device])
                processes[device] = start(device)
            echo(f"started {len(processes)} agent processes; waiting for them to come online")
            coordinator.wait_for_devices(spec.agents, spec.startup_timeout,
                                         progress=lambda n, total: echo(f"  {n}/{total} agents online"))
            if spec.churn:
                fraction, seconds = fleet.parse_churn(spec.churn)
                horizon = spec.rounds * settings.round_timeout
                churn = fleet.Churn(fleet.churn_schedule(devices, fraction, seconds, horizon, spec.seed),
                                    processes, lambda device: start(device, again=True), echo)
                echo(f"churn: about {fraction:.0%} of devices offline at a time, {seconds:.0f} s on average")
                churn.start()
            started = time.time()  # wall-clock from the first task: accuracy against time (bench/buffered.py)
            for round_no in range(1, spec.rounds + 1):
                try:
                    record = record_dict(coordinator.run_round(round_no))
                except BudgetSpent as exc:  # [privacy] target_epsilon: the round is not opened
                    echo(f"stopped: {exc}")
                    break
                record["elapsed"] = round(time.time() - started, 3)
                offline = churn.offline() if churn else set()
                for device, values in record["devices"].items() if classes else ():
                    values["device_class"] = classes.get(device, "")
                record["cohort"], record["offline"] = sorted(cohort), sorted(offline)
                history.append(record)
                if tracker:
                    tracker.round(record)
                echo(format_round(record, spec.rounds))
                dead = [d for d, p in processes.items() if p.poll() is not None and d not in offline]
                if dead:
                    echo(f"warning: {len(dead)} agent process(es) exited; see {devices_dir / dead[0] / 'agent.log'}")
        finally:
            if churn:
                churn.stop()
            stop_processes(list(processes.values()))
            if groups:
                groups.remove()

    out.mkdir(parents=True, exist_ok=True)
    meta = {"dataset": data.name if data else f"own data ({spec.devices_dir})", "model": model,
            "task": objective.task, "loss": objective.loss, "metric": objective.metric,
            "evaluated": {"central": central, "devices": on_devices}, "agents": spec.agents,
            "partition": (spec.partition_file.name if spec.partition_file else spec.partition) if data else None,
            "seed": spec.seed, "algorithm": settings.algorithm, "codec": coordinator.settings.codec,
            "local_epochs": settings.local_epochs, "momentum": settings.momentum,
            "round_timeout": settings.round_timeout, "fleet": spec.fleet, "churn": spec.churn,
            "device_classes": classes, "fleet_limits": groups is not None, "churn_events": churn.events if churn else [],
            "mode": settings.mode, "aggregator": settings.aggregator, "downlink": settings.downlink,
            "sites": spec.sites}  # buffered: each record is a version, --rounds counts versions
    if settings.mode == "buffered":
        meta.update(buffer_size=settings.buffer_size, max_staleness=settings.max_staleness,
                    staleness_weight=settings.staleness_weight)
    write_history(out / "history.json", history, meta)
    plot = out / ("accuracy.png" if objective.metric == "accuracy" else f"{objective.metric}.png")
    plotted = plot_accuracy(plot, history, f"{settings.algorithm} on {meta['dataset']}, "
                            f"{spec.agents} agents" + (f", {spec.partition}" if data else ""))
    echo(f"wrote {out / 'history.json'}" + (f" and {plot}" if plotted else
                                              " (no plot: matplotlib is not installed)"))
    if tracker:
        tracker.finish([out / "history.json"], f"{settings.algorithm} on {meta['dataset']}")
        echo(f"tracked in {tracker.describe()}" + (f" ({sum(tracker.failures.values())} failed writes, see the log)"
                                                    if tracker.failures else ""))
    return history
