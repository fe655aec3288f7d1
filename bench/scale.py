"""Scale benchmark (issue 14): a fleet of emulated devices flat on one broker, and the same fleet
over site brokers bridged to a central one. Writes bench/results/scale.json and scale.md.

Per topology: bytes into and out of the central broker per round (Mosquitto's
`$SYS/broker/bytes/received` and `/sent`, `sys_interval 1`), the coordinator's CPU-seconds per
accepted update, round completion time, and the peak RSS of every process. The devices are
`bench/crowd.py` processes (real MQTT clients with their own credentials; a precomputed update
in the default codec, re-signed per task; each tasked device fetches the model version it is
tasked with from its broker's retained chunks). Site aggregators are the real
`broker-coordinator site-aggregator` command, one worker per site; the coordinator runs in its
own process, so that its CPU time and RSS are its own.

    python -m bench.scale                      # 10,000 devices, 4 sites, 1,000 per round; tree also at 10,000
    python -m bench.scale --quick              # 2,000 devices, 200 per round (a few minutes)
    python -m bench.scale --report             # rebuild scale.json / .md (bytes_per_client_round) from the last run

Both topologies fold with the default fold (`centered_clip`: at the sites, and at the centre over
the sites' partials) and algorithm fedavg, whose server rule keeps no per-device state (a rule that
does, e.g. dynsam, adds one row per device to each partial).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from bench.crowd import device_key  # noqa: E402
from bench.runtime import RssSampler  # noqa: E402
from broker_coordinator.settings.choices import DEFAULT_AGGREGATOR  # noqa: E402
from bench import provenance  # noqa: E402
from broker_coordinator.access.broker import COORDINATOR_USER  # noqa: E402
from broker_coordinator.simulation.private_broker import PrivateBroker  # noqa: E402
from broker_coordinator.simulation.local_sites import LocalSites  # noqa: E402
from broker_coordinator.simulation.processes import stop_processes  # noqa: E402
from edgefl_protocol import signing  # noqa: E402

FED = "scale"
RESULTS = ROOT / "bench" / "results"
SYS_USER = "bench-sys"
SYS_ACL = f"\nuser {SYS_USER}\ntopic read $SYS/broker/bytes/#\n"
PER_CROWD = 2500  # clients per crowd process


def raise_open_files(needed: int) -> int:
    """Each client holds a socket (and paho a socket pair); each broker one per client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, needed)
    if want > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            want = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def write_body(workdir: Path) -> Path:
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol import codec
    from edgefl_models.architectures import build_model, get_weights
    weights = get_weights(build_model("mnist_cnn"))
    rng = np.random.default_rng(0)
    encoded = codec.encode({k: rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in weights.items()},
                           RoundSettings().codec)
    path = workdir / "body.bin"
    path.write_bytes(msgpack.packb({"codec": encoded.codec, "specs": encoded.specs, "body": encoded.body},
                                   use_bin_type=True))
    return path


def spawn_crowds(workdir: Path, port: int, devices: list[tuple[str, str]], body: Path, fetch: bool,
                 tag: str) -> list[subprocess.Popen]:
    crowds = []
    for start in range(0, len(devices), PER_CROWD):
        spec = workdir / f"crowd-{tag}-{start}.json"
        spec.write_text(json.dumps({"federation": FED, "host": "127.0.0.1", "port": port, "body_file": str(body),
                                    "fetch_model": fetch, "devices": devices[start:start + PER_CROWD]}))
        log = open(workdir / f"crowd-{tag}-{start}.log", "wb")
        crowds.append(subprocess.Popen([sys.executable, str(ROOT / "bench" / "crowd.py"), str(spec)],
                                       stdout=subprocess.PIPE, stderr=log, text=True))
    for crowd in crowds:
        line = crowd.stdout.readline().strip()
        if not line.startswith("ready"):
            raise RuntimeError(f"a crowd process failed to connect its clients (see {workdir}/crowd-{tag}-*.log)")
    return crowds


def run_coordinator(workdir: Path, topology: str, port: int, password: str, sys_password: str, devices: int,
                    participants: list[int], rounds: int, sites: list[str], timeout: float) -> subprocess.Popen:
    result = workdir / f"coordinator-{topology}.json"
    return subprocess.Popen([sys.executable, "-m", "bench.scale", "_coordinator", "--topology", topology,
                             "--port", str(port), f"--password={password}", f"--sys-password={sys_password}",
                             "--devices", str(devices), "--participants", ",".join(map(str, participants)),
                             "--rounds", str(rounds), "--sites", ",".join(sites), "--timeout", str(timeout),
                             "--result", str(result)], cwd=ROOT,
                            stdout=open(workdir / f"coordinator-{topology}.log", "wb"), stderr=subprocess.STDOUT)


def finish(coordinator: subprocess.Popen, sampler: RssSampler, workdir: Path, topology: str,
           names: dict[int, str]) -> dict:
    coordinator.wait()
    peaks = sampler.stop()
    if coordinator.returncode != 0:
        log = (workdir / f"coordinator-{topology}.log").read_text(errors="replace")
        raise RuntimeError(f"the {topology} coordinator failed:\n{log[-3000:]}")
    out = json.loads((workdir / f"coordinator-{topology}.json").read_text())
    out["peak_rss_mb"] = {names[pid]: round(rss / 2**20, 1) for pid, rss in peaks.items() if pid in names}
    out["peak_rss_mb"]["coordinator"] = round(out.pop("coordinator_peak_rss_mb"), 1)
    return out


def flat_run(workdir: Path, devices: list[str], participants: int, rounds: int, body: Path, timeout: float) -> dict:
    sys_password = signing.new_key().hex()
    users = {COORDINATOR_USER: signing.new_key().hex(), SYS_USER: sys_password,
             **{d: device_key(d).hex()[:32] for d in devices}}
    broker = PrivateBroker(workdir / "flat", FED, users=users, extra_acl=SYS_ACL, extra_conf="sys_interval 1\n",
                           max_queued_messages=4 * len(devices))
    with broker:
        crowds = spawn_crowds(workdir, broker.port, [(d, users[d]) for d in devices], body, True, "flat")
        try:
            coordinator = run_coordinator(workdir, "flat", broker.port, users[COORDINATOR_USER], sys_password,
                                          len(devices), [participants], rounds, [], timeout)
            names = {broker.process.pid: "central broker", **{c.pid: f"crowd {i}" for i, c in enumerate(crowds)}}
            sampler = RssSampler([*names, coordinator.pid])
            return finish(coordinator, sampler, workdir, "flat", names)
        finally:
            stop_processes(crowds, timeout=30)


def tree_run(workdir: Path, devices: list[str], sites: int, participants: list[int], rounds: int, body: Path,
             timeout: float, fetch: bool) -> dict:
    from broker_coordinator.settings.site_settings import SiteSettings
    from broker_coordinator.access.sites import aggregator_toml
    names_of = [f"site{i}" for i in range(sites)]
    where = {s: devices[i::sites] for i, s in enumerate(names_of)}
    sys_password = signing.new_key().hex()
    rig = LocalSites(workdir / "tree", FED, where, sys_interval=1, central_users_extra={SYS_USER: sys_password},
                     central_acl_extra=SYS_ACL)
    workers: list[subprocess.Popen] = []
    crowds: list[subprocess.Popen] = []
    with rig:
        try:
            for site in names_of:
                key_file = workdir / f"{site}-keys.toml"
                signing.write_key_file(key_file, {d: device_key(d) for d in where[site]})
                config = workdir / f"{site}-aggregator.toml"
                settings = SiteSettings(site, "*", port=rig.brokers[site].port)
                config.write_text(aggregator_toml(FED, "mnist_cnn", settings, rig.coordinator_password, key_file))
                workers.append(subprocess.Popen([sys.executable, "-m", "broker_coordinator", "site-aggregator",
                                                 "--config", str(config), "--log-level", "WARNING"], cwd=ROOT,
                                                stdout=open(workdir / f"{site}-aggregator.log", "wb"),
                                                stderr=subprocess.STDOUT))
            for site in names_of:
                crowds += spawn_crowds(workdir, rig.brokers[site].port, [(d, rig.passwords[d]) for d in where[site]],
                                       body, fetch, site)
            coordinator = run_coordinator(workdir, "tree", rig.central.port, rig.coordinator_password, sys_password,
                                          len(devices), participants, rounds, names_of, timeout)
            names = {rig.central.process.pid: "central broker",
                     **{rig.brokers[s].process.pid: f"{s} broker" for s in names_of},
                     **{w.pid: f"{s} aggregator" for s, w in zip(names_of, workers)},
                     **{c.pid: f"crowd {i}" for i, c in enumerate(crowds)}}
            sampler = RssSampler([*names, coordinator.pid])
            cpu_before = sampler.cpu_seconds()
            out = finish(coordinator, sampler, workdir, "tree", names)
            cpu_after = sampler.cpu_seconds()
            folded = sum(p["accepted"] for p in out["phases"])
            site_cpu = sum(cpu_after.get(w.pid, 0) - cpu_before.get(w.pid, 0) for w in workers)
            out["site_aggregator_cpu_s_per_update"] = site_cpu / folded if folded else None
            return out
        finally:
            stop_processes(crowds, timeout=30)
            stop_processes(workers, timeout=15)


# the coordinator's process -----------------------------------------------------------------------
class SysCounters:
    """The central broker's byte counters, from its $SYS topics (published every sys_interval)."""

    def __init__(self, port: int, password: str) -> None:
        from edgefl_protocol.transport import connect, make_client
        self.values: dict[str, tuple[float, int]] = {}
        self.lock = threading.Lock()
        self.client = make_client(SYS_USER, SYS_USER, password)
        self.client.on_message = self._on_message
        connect(self.client, "127.0.0.1", port, timeout=30)
        self.client.subscribe([("$SYS/broker/bytes/received", 0), ("$SYS/broker/bytes/sent", 0)])

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        with self.lock:
            self.values[msg.topic.rsplit("/", 1)[1]] = (time.monotonic(), int(msg.payload))

    def fresh(self, timeout: float = 10.0) -> dict[str, int]:
        """Counters that include everything sent before this call. Mosquitto republishes a $SYS value
        at each sys_interval only when it changed, so after two intervals the last value is current."""
        time.sleep(2.2)
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            with self.lock:
                if len(self.values) == 2:
                    return {k: v for k, (_, v) in self.values.items()}
            time.sleep(0.05)
        raise TimeoutError("the central broker published no $SYS byte counters (sys_interval set?)")


class TimedObjective:
    """The coordinator's objective, its evaluations' CPU seconds added to `spent[0]` (bench only)."""

    def __init__(self, inner: object, spent: list[float]) -> None:
        self.inner, self.spent = inner, spent

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def evaluate(self, *args: object, **kwargs: object) -> object:
        started = time.process_time()
        try:
            return self.inner.evaluate(*args, **kwargs)
        finally:
            self.spent[0] += time.process_time() - started


def coordinator_main(args: argparse.Namespace) -> None:
    from broker_coordinator.engine.loop import Engine
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.access.sites import site_key
    from broker_coordinator.engine.tree import SiteSpec
    from edgefl_models import datasets
    data = datasets.load("mnist5k")
    settings = RoundSettings(algorithm="fedavg", round_timeout=args.timeout, min_updates=1,
                             max_attempts=1)  # the default fold, at the sites and at the centre
    if args.topology == "flat":
        keys = {f"dev-{i:05d}": device_key(f"dev-{i:05d}") for i in range(args.devices)}
        coordinator = Engine(FED, "mnist_cnn", data.test, settings, device_keys=keys)
    else:
        sites = {s: SiteSpec(1, site_key(args.password, s)) for s in args.sites.split(",")}
        coordinator = Engine(FED, "mnist_cnn", data.test, settings, sites=sites)
    evaluation_cpu = [0.0]  # the central evaluation's share: fixed per round, whatever the participants
    coordinator.objective = TimedObjective(coordinator.objective, evaluation_cpu)
    coordinator.connect("127.0.0.1", args.port, COORDINATOR_USER, args.password)
    counters = SysCounters(args.port, args.sys_password)
    coordinator.wait_for_devices(args.devices, timeout=600)
    phases = []
    for participants in [int(p) for p in args.participants.split(",")]:
        coordinator.settings.clients_per_round = participants
        before = counters.fresh()
        cpu, evaluation_cpu[0] = time.process_time(), 0.0
        records = [coordinator.run_round() for _ in range(args.rounds)]
        cpu = time.process_time() - cpu
        after = counters.fresh()
        accepted = sum(r.participants for r in records)
        phases.append({
            "participants": participants, "rounds": len(records),
            "accepted": accepted, "selected": sum(r.selected for r in records),
            "closed": [r.closed for r in records],
            "central_bytes_in_per_round": (after["received"] - before["received"]) / len(records),
            "central_bytes_out_per_round": (after["sent"] - before["sent"]) / len(records),
            "round_seconds": [round(r.seconds, 2) for r in records],
            "coordinator_cpu_s_per_update": cpu / accepted if accepted else None,
            "coordinator_evaluation_cpu_s_per_round": evaluation_cpu[0] / len(records),
            "coordinator_cpu_s_per_update_without_evaluation": (cpu - evaluation_cpu[0]) / accepted
            if accepted else None,
            "rejected": [r.rejected for r in records]})
        print(json.dumps(phases[-1]), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.result).write_text(json.dumps({"phases": phases, "coordinator_peak_rss_mb": peak / 2**20}))
    counters.client.disconnect()
    coordinator.close()


# report ------------------------------------------------------------------------------------------
def total(phase: dict) -> float:
    return phase["central_bytes_in_per_round"] + phase["central_bytes_out_per_round"]


def bytes_per_client_round() -> tuple[dict | None, str]:
    path = RESULTS / "downlink.json"
    if path.exists():
        found = json.loads(path.read_text()).get("bytes_per_client_round")
        if isinstance(found, dict) and {"up", "down"} <= set(found):
            return {"up": found["up"], "down": found["down"]}, f"copied from {path.name} (a real field run)"
    return None, ("bench/results/downlink.json (the field run of the delta downlink) did not exist when this ran; "
                  "this benchmark's devices are emulated and do not train, so it does not measure it")


def report(flat: dict, tree: dict, args: argparse.Namespace, seconds: float) -> dict:
    f1, t1 = flat["phases"][0], tree["phases"][0]
    per_client, note = bytes_per_client_round()
    out = {
        "central_bytes_per_round": {"flat": total(f1), "tree": total(t1)},
        "participants": args.participants, "sites": args.sites, "devices": args.devices,
        "round_seconds": {"flat": statistics.median(f1["round_seconds"]),
                          "tree": statistics.median(t1["round_seconds"])},
        "coordinator_cpu_s_per_update": {"flat": f1["coordinator_cpu_s_per_update"],
                                         "tree": t1["coordinator_cpu_s_per_update"]},
        "coordinator_cpu_s_per_update_without_evaluation": {
            "flat": f1.get("coordinator_cpu_s_per_update_without_evaluation"),
            "tree": t1.get("coordinator_cpu_s_per_update_without_evaluation")},
        "coordinator_evaluation_cpu_s_per_round": {"flat": f1.get("coordinator_evaluation_cpu_s_per_round"),
                                                   "tree": t1.get("coordinator_evaluation_cpu_s_per_round")},
        "bytes_per_client_round": per_client, "bytes_per_client_round_note": note,
        "ratio_flat_over_tree": total(f1) / total(t1),
        "tree_by_participants": {str(p["participants"]): total(p) for p in tree["phases"]},
        "site_aggregator_cpu_s_per_update": tree.get("site_aggregator_cpu_s_per_update"),
        "peak_rss_mb": {"flat": flat["peak_rss_mb"], "tree": tree["peak_rss_mb"]},
        "details": {"flat": flat["phases"], "tree": tree["phases"]},
        "settings": {"rounds_per_phase": args.rounds, "algorithm": "fedavg", "aggregator": DEFAULT_AGGREGATOR,
                     "devices_fetch_model": "flat: yes; tree: " + ("yes" if not args.tree_no_fetch else "no"),
                     "wall_seconds": round(seconds)},
    }
    if len(tree["phases"]) > 1:
        low, high = total(tree["phases"][0]), total(tree["phases"][-1])
        out["tree_growth_low_to_high"] = high / low - 1
    return out


def evaluation_share(out: dict) -> list[str]:
    """The central evaluation's part of the coordinator's CPU: fixed per round, so per update it
    shrinks as participants grow, and it is the operator's choice (`evaluate`), not the fold's."""
    bare, evaluation = out.get("coordinator_cpu_s_per_update_without_evaluation"), \
        out.get("coordinator_evaluation_cpu_s_per_round")
    if not bare or bare.get("tree") is None:
        return []
    return [f"- Of that, the central evaluation of each round's model on the test set: {evaluation['flat']:.3f} s "
            f"(flat) and {evaluation['tree']:.3f} s (tree) of CPU per round; without it, {1000 * bare['flat']:.2f} ms "
            f"(flat) and {1000 * bare['tree']:.2f} ms (tree) per update."]


def markdown(out: dict) -> str:
    r = out["round_seconds"]
    cpu = out["coordinator_cpu_s_per_update"]
    lines = ["# Scale: flat against sites (bench/scale.py)", "",
             f"{out['devices']} emulated devices, {out['participants']} per round, {out['sites']} sites, "
             f"{out['settings']['rounds_per_phase']} rounds per row; fedavg, aggregator "
             f"{out['settings']['aggregator']}.", "",
             "| topology | participants | central MB in / round | central MB out / round | central MB / round | "
             "round s (median) | coordinator CPU ms / update | rejected |", "|---|---|---|---|---|---|---|---|"]
    for name in ("flat", "tree"):
        for p in out["details"][name]:
            lines.append(f"| {name} | {p['participants']} | {p['central_bytes_in_per_round'] / 1e6:.2f} | "
                         f"{p['central_bytes_out_per_round'] / 1e6:.2f} | {total(p) / 1e6:.2f} | "
                         f"{statistics.median(p['round_seconds']):.1f} | "
                         f"{1000 * (p['coordinator_cpu_s_per_update'] or 0):.2f} | {p['rejected']} |")
    ratio = out["ratio_flat_over_tree"]
    lines += ["", f"- Central bytes per round, flat / tree at {out['participants']} participants: **{ratio:.1f}x** "
                  f"(target >= 20x: {'met' if ratio >= 20 else 'missed'}).",
              f"- Engine CPU per accepted update: flat {1000 * cpu['flat']:.2f} ms, tree {1000 * cpu['tree']:.2f} "
              f"ms; site aggregators {1000 * (out['site_aggregator_cpu_s_per_update'] or 0):.2f} ms per update.",
              *evaluation_share(out),
              f"- Round seconds (median): flat {r['flat']:.1f}, tree {r['tree']:.1f}."]
    if "tree_growth_low_to_high" in out:
        g = out["tree_growth_low_to_high"]
        keys = list(out["tree_by_participants"])
        lines.append(f"- Tree central bytes per round from {keys[0]} to {keys[-1]} participants at {out['sites']} "
                     f"sites: {100 * g:+.1f}% (target within 10%: {'met' if abs(g) <= 0.10 else 'missed'}). "
                     "What grows is what grows with a round's duration (each site reports its presence at most "
                     "once a second while its counts change), not with its devices: a site task and a partial "
                     "per site whatever the number of participants.")
    lines += ["- These rows use fedavg, whose server rule keeps no per-device state. A rule that does (dynsam, "
              "the default; drsam) makes each partial carry one row per device with just the metrics the rule "
              "reads (dynsam: sigma, gamma; about 26 bytes with the device id, from a field run's metrics): "
              "about +0.26 MB a round at 10,000 participants, an estimate from the row size, not measured here.",
              f"- bytes_per_client_round: {out['bytes_per_client_round']} ({out['bytes_per_client_round_note']}).",
              "", "Peak RSS (MB):", ""]
    for name, peaks in out["peak_rss_mb"].items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(peaks.items())))
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["_coordinator"]:
        p = argparse.ArgumentParser()
        for name in ("--topology", "--password", "--sys-password", "--participants", "--sites", "--result"):
            p.add_argument(name, default="")
        for name in ("--port", "--devices", "--rounds"):
            p.add_argument(name, type=int)
        p.add_argument("--timeout", type=float)
        coordinator_main(p.parse_args(sys.argv[2:]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--participants", type=int, default=1000)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree-participants", default="1000,10000",
                        help="participants per round of the tree's rows (the first must equal --participants)")
    parser.add_argument("--tree-no-fetch", action="store_true",
                        help="tree devices answer without fetching the model from their site broker (its bytes "
                             "never reach the central broker; saves the machine 321 KB per device-round)")
    parser.add_argument("--timeout", type=float, default=600.0, help="round timeout, seconds")
    parser.add_argument("--quick", action="store_true", help="2,000 devices, 200 per round, tree also at 2,000")
    parser.add_argument("--out", default="scale")
    parser.add_argument("--report", action="store_true",
                        help="rewrite scale.json and .md from the last run (e.g. once downlink.json exists)")
    args = parser.parse_args()
    if args.report:
        path = RESULTS / f"{args.out}.json"
        out = json.loads(path.read_text())
        out["bytes_per_client_round"], out["bytes_per_client_round_note"] = bytes_per_client_round()
        path.write_text(json.dumps(out, indent=2) + "\n")
        (RESULTS / f"{args.out}.md").write_text(markdown(out))
        print(markdown(out))
        return 0
    if args.quick:
        args.devices, args.participants, args.tree_participants, args.rounds = 2000, 200, "200,2000", 2
    tree_participants = [int(p) for p in args.tree_participants.split(",")]
    if tree_participants[0] != args.participants:
        parser.error("--tree-participants must start with --participants")
    raise_open_files(4 * args.devices + 4096)
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="edgefl-scale-"))
    body = write_body(workdir)
    devices = [f"dev-{i:05d}" for i in range(args.devices)]
    print(f"flat: {args.devices} devices on one broker, {args.participants} per round", flush=True)
    flat = flat_run(workdir, devices, args.participants, args.rounds, body, args.timeout)
    print(json.dumps(flat["phases"]), flush=True)
    print(f"tree: {args.sites} sites, participants {tree_participants}", flush=True)
    tree = tree_run(workdir, devices, args.sites, tree_participants, args.rounds, body, args.timeout,
                    not args.tree_no_fetch)
    print(json.dumps(tree["phases"]), flush=True)
    out = report(flat, tree, args, time.time() - started)
    from broker_coordinator.settings.round_settings import RoundSettings
    out["measured_with"] = provenance.measured_with(
        provenance.invoked(), {k: v for k, v in provenance.deciding(RoundSettings(algorithm="fedavg")).items()
                               if k not in ("topology", "local_epochs")},
        local_epochs="n/a: emulated devices send precomputed updates", varies={"topology": ["flat", "sites"]},
        data="n/a: no training", seeds="n/a")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(out))
    print(markdown(out))
    print(f"run files: {workdir}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
