"""A whole federation on one machine, through the same parts as production:
a private Mosquitto with generated credentials and ACL, one agent *process*
per device reading its own data file, and the coordinator's round loop.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from edgefl_protocol import signing
from edgefl_protocol.settings import to_toml
from models import datasets, partition

from .broker import COORDINATOR_USER, PrivateBroker
from .coordinator import Coordinator, RoundSettings, record_dict
from .metrics import Metrics
from .processes import stop_processes
from .store import Store
from .report import format_round, plot_accuracy, write_history

log = logging.getLogger("broker_coordinator.simulate")
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


def prepare_shards(spec: SimulationSpec, data: datasets.FederatedData, devices_dir: Path) -> list[Path]:
    parts = partition.split(spec.partition, data.train.y, spec.agents, spec.seed, data.natural_shards)
    paths = []
    for i, index in enumerate(parts):
        path = devices_dir / f"dev-{i:03d}" / "data.npz"
        datasets.save_npz(path, data.train.subset(index))
        paths.append(path)
    return paths


def write_agent_config(path: Path, device: str, password: str, port: int, spec: SimulationSpec, data: Path,
                       signing_key: bytes | None = None) -> None:
    """The agent config format of edge_agent/config.py, as a device would have it after enrollment."""
    sections = {
        "broker": {"host": "127.0.0.1", "port": port, "username": device, "password": password},
        "device": {"id": device, "data": str(data), "state_dir": str(path.parent / "state"),
                   "federation": spec.federation, "threads": spec.agent_threads,
                   "signing_key": signing_key.hex() if signing_key else None},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(to_toml(sections))


def spawn_agent(config: Path, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    with open(log_path, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "edge_agent", "run", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def simulate(spec: SimulationSpec, settings: RoundSettings, echo=print, spawn=spawn_agent) -> list[dict]:
    """Run the federation; write history.json and accuracy.png into spec.out; return the rounds.

    `spawn(config, log_path)` starts one agent process (bench/pi/pi_check.py starts one under emulation)."""
    settings.validate()
    data = datasets.load(spec.dataset, num_users=spec.agents, seed=spec.seed)
    out = spec.out
    run_dir = out / "run"
    if (run_dir / RUN_MARKER).exists():
        shutil.rmtree(run_dir)  # a simulation starts fresh; only a directory we made is removed
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_MARKER).write_text("created by broker-coordinator simulate; removed by the next run\n")
    devices_dir = run_dir / "devices"
    shard_paths = prepare_shards(spec, data, devices_dir)
    echo(f"{data.name}: {len(data.train)} training samples over {spec.agents} agents ({spec.partition}), "
         f"{len(data.test)} held out for the coordinator")

    broker = PrivateBroker(run_dir / "broker", spec.federation, port=spec.broker_port, mosquitto=spec.mosquitto)
    coordinator_password = broker.add_user(COORDINATOR_USER)
    devices = [f"dev-{i:03d}" for i in range(spec.agents)]
    passwords = {device: broker.add_user(device) for device in devices}
    keys = {device: signing.new_key() for device in devices}  # per-device update signing keys
    processes: list[subprocess.Popen] = []
    history: list[dict] = []
    with broker:
        echo(f"mosquitto listening on 127.0.0.1:{broker.port} (no anonymous access, per-device ACL)")
        metrics = Metrics()
        if spec.metrics_port:
            metrics.serve(spec.metrics_port)
            echo(f"Prometheus metrics on http://127.0.0.1:{spec.metrics_port}/metrics")
        coordinator = Coordinator(spec.federation, data.model, data.test, settings, seed=spec.seed,
                                  store=Store(run_dir / "coordinator"), metrics=metrics, device_keys=keys)
        coordinator.connect("127.0.0.1", broker.port, COORDINATOR_USER, coordinator_password)
        try:
            for device, shard in zip(devices, shard_paths):
                config = shard.parent / "agent.toml"
                write_agent_config(config, device, passwords[device], broker.port, spec, shard, keys[device])
                processes.append(spawn(config, shard.parent / "agent.log"))
            echo(f"started {len(processes)} agent processes; waiting for them to come online")
            coordinator.wait_for_devices(spec.agents, spec.startup_timeout,
                                         progress=lambda n, total: echo(f"  {n}/{total} agents online"))
            for round_no in range(1, spec.rounds + 1):
                record = record_dict(coordinator.run_round(round_no))
                history.append(record)
                echo(format_round(record, spec.rounds))
                dead = [p.args[-1] for p in processes if p.poll() is not None]
                if dead:
                    echo(f"warning: {len(dead)} agent process(es) exited; see agent.log beside {dead[0]}")
        finally:
            stop_processes(processes)
            coordinator.close()

    out.mkdir(parents=True, exist_ok=True)
    meta = {"dataset": data.name, "model": data.model, "agents": spec.agents, "partition": spec.partition,
            "seed": spec.seed, "algorithm": settings.algorithm}
    write_history(out / "history.json", history, meta)
    plotted = plot_accuracy(out / "accuracy.png", history,
                            f"{settings.algorithm} on {data.name}, {spec.agents} agents, {spec.partition}")
    echo(f"wrote {out / 'history.json'}" + (f" and {out / 'accuracy.png'}" if plotted else
                                              " (no plot: matplotlib is not installed)"))
    return history
