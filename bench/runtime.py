"""Runtime benchmark (issue 5). Writes bench/results/runtime.json and runtime.md.

1. Orchestration overhead: round wall time (tasks out -> new global model)
   against the slowest selected client's own training time, with real agent
   processes training the MNIST CNN, for 10 and 50 agents.
2. Scale: 100, 300, 1,000 lightweight simulated devices (bench/swarm.py: real
   MQTT clients, precomputed updates, no training) through Mosquitto into one
   coordinator process: round completion time, updates/s, coordinator peak RSS.
3. Agent footprint: peak RSS of an agent process (one torch thread, MNIST CNN)
   during rounds, against a bare `python -c "import torch"` in the same run;
   CPU seconds per round.

    python bench/runtime.py            # full (about 10 minutes on 2 idle cores)
    python bench/runtime.py --quick    # 10 agents, 100/300 devices, fewer rounds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import broker_coordinator  # noqa: E402,F401  # first: it sets the coordinator's BLAS threads, as `run` has them
import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from broker_coordinator.access.broker import COORDINATOR_USER  # noqa: E402
from broker_coordinator.simulation.private_broker import PrivateBroker  # noqa: E402
from broker_coordinator.engine.loop import Engine  # noqa: E402
from broker_coordinator.settings.round_settings import RoundSettings  # noqa: E402
from broker_coordinator.engine.rounds import RoundState  # noqa: E402
from broker_coordinator.simulation.processes import stop_processes  # noqa: E402
from broker_coordinator.simulation.simulate import (SimulationSpec, prepare_shards, spawn_agent,  # noqa: E402
                                         write_agent_config)
from broker_coordinator.storage.store import Store  # noqa: E402
from edgefl_protocol import codec, signing  # noqa: E402
from bench import provenance  # noqa: E402
from edgefl_models import datasets  # noqa: E402
from edgefl_models.architectures import build_model, get_weights  # noqa: E402

FED = "bench"
# Every part runs the shipped defaults (RoundSettings()), setting only what the part must.
OVERHEAD_SETTINGS = RoundSettings()  # real agents: each chooses its local epochs (local_epochs=0), dynsam, ...


SCALE_ROUNDS = 7  # a round of 100 updates lasts 0.4 s: medians of 3 of them moved by a third between runs


def scale_settings(size: int) -> RoundSettings:
    """The scale part's coordinator: the defaults, but a round waits for every simulated device
    (min_updates) and a long deadline, so that a round measures the whole cohort's intake."""
    return RoundSettings(round_timeout=600, min_updates=size)


# What the scale part's devices do differently from a real agent (written into measured_with and runtime.md)
SWARM_DIFFERS = ("the swarm devices (bench/swarm.py) send one precomputed signed update of the MNIST CNN in the "
                 "default codec, with the metrics a real dynsam agent sends (but the model_sha of the release it "
                 "trained on, which it never fetches), instead of training: no local epochs and no model download; "
                 "the coordinator waits for all of them (min_updates = devices, round_timeout 600 s)")


class RssSampler:
    """Peak RSS and CPU time of a set of processes, sampled every 50 ms."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.peak = {p.pid: 0 for p in self.procs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for p in self.procs:
                try:
                    self.peak[p.pid] = max(self.peak[p.pid], p.memory_info().rss)
                except psutil.Error:
                    pass

    def cpu_seconds(self) -> dict[int, float]:
        out = {}
        for p in self.procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def swarm_update() -> tuple[codec.Encoded, dict[str, tuple[int, ...]]]:
    """The one update every swarm device sends: a small random delta of the MNIST CNN in the codec
    the coordinator's tasks name; and the CNN's tensor shapes."""
    weights = get_weights(build_model("mnist_cnn"))
    rng = np.random.default_rng(0)
    encoded = codec.encode({k: rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in weights.items()},
                           RoundSettings().codec)
    return encoded, codec.specs_of(weights)


def reference_decode_ms(repeats: int = 300) -> float:
    """This machine's speed on a fixed piece of the coordinator's work: the median time to decode the
    swarm's update (zlib, msgpack, dequantization, numpy), in this process, no broker. updates/s
    moves with the machine (2x between two hosts of this project at the same commit); this number
    says how fast the host was, so that runs on different hosts compare."""
    encoded, expected = swarm_update()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codec.decode(encoded.codec, encoded.specs, encoded.body, expected, 10**7)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def bare_torch_rss() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "import torch, time; torch.set_num_threads(1); time.sleep(4)"])
    sampler = RssSampler([proc.pid])
    proc.wait()
    return sampler.stop()[proc.pid]


def overhead_run(agents: int, rounds: int, workdir: Path) -> dict:
    spec = SimulationSpec(agents=agents, rounds=rounds, dataset="mnist5k", partition="dirichlet:0.3",
                          federation=FED, out=workdir)
    data = datasets.load("mnist5k")
    shards = prepare_shards(spec, data, workdir / "devices")
    broker = PrivateBroker(workdir / "broker", FED)
    password = broker.add_user(COORDINATOR_USER)
    devices = [f"dev-{i:03d}" for i in range(agents)]
    passwords = {d: broker.add_user(d) for d in devices}
    keys = {d: signing.new_key() for d in devices}
    marks: dict[int, dict[str, float]] = {}

    def on_state(rnd):
        marks.setdefault(rnd.number, {})[rnd.state.value] = time.time()
        if rnd.state == RoundState.OPEN:
            marks[rnd.number]["start"] = rnd.started

    processes = []
    with broker:
        coordinator = Engine(FED, data.model, data.test, OVERHEAD_SETTINGS,
                                  store=Store(workdir / "coordinator"), on_state=on_state, device_keys=keys)
        coordinator.connect(broker.host, broker.port, COORDINATOR_USER, password)
        try:
            for device, shard in zip(devices, shards):
                config = shard.parent / "agent.toml"
                write_agent_config(config, device, passwords[device], broker.port, spec, shard, keys[device])
                processes.append(spawn_agent(config, shard.parent / "agent.log"))
            coordinator.wait_for_devices(agents, 600)
            sampler = RssSampler([p.pid for p in processes])
            rows = []
            cpu_before = sampler.cpu_seconds()
            for r in range(1, rounds + 1):
                record = coordinator.run_round(r)
                slowest = max(float(m["train_seconds"]) for m in record.devices.values())
                m = marks[r]
                rows.append({"round": r, "slowest_train_s": slowest,
                             "orchestrated_s": m["aggregated"] - m["start"], "full_round_s": record.seconds,
                             "participants": record.participants, "rejected": dict(record.rejected),
                             "epochs_chosen": sorted({int(m.get("epochs", 0)) for m in record.devices.values()})})
            cpu_after = sampler.cpu_seconds()
            peaks = sampler.stop()
        finally:
            stop_processes(processes)
            coordinator.close()
    measured = rows[1:] if len(rows) > 1 else rows  # round 1 includes each agent's first model build
    ratios = [row["orchestrated_s"] / row["slowest_train_s"] for row in measured]
    full = [row["full_round_s"] / row["slowest_train_s"] for row in measured]
    cpu_per_round = [(cpu_after[p] - cpu_before[p]) / rounds for p in cpu_after if p in cpu_before]
    return {"agents": agents, "rounds": rows, "overhead_ratio": statistics.median(ratios),
            "overhead_ratio_with_eval_and_checkpoint": statistics.median(full),
            "agent_peak_rss_mb": [v / 2**20 for v in peaks.values()],
            "agent_cpu_s_per_round_median": statistics.median(cpu_per_round)}


def scale_run(size: int, rounds: int, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    broker = PrivateBroker(workdir / "broker", FED)
    password = broker.add_user(COORDINATOR_USER)
    devices = [(f"sim-{i:04d}", broker.add_user(f"sim-{i:04d}")) for i in range(size)]
    encoded, _ = swarm_update()
    (workdir / "body.bin").write_bytes(msgpack.packb(
        {"codec": encoded.codec, "specs": encoded.specs, "body": encoded.body}, use_bin_type=True))
    swarms = []
    with broker:
        chunk = 250
        for start in range(0, size, chunk):
            spec_path = workdir / f"swarm-{start}.json"
            spec_path.write_text(json.dumps({"federation": FED, "host": broker.host, "port": broker.port,
                                             "body_file": str(workdir / "body.bin"),
                                             "devices": devices[start:start + chunk]}))
            swarms.append(subprocess.Popen([sys.executable, str(ROOT / "bench" / "swarm.py"), str(spec_path)],
                                           stdout=subprocess.PIPE, text=True))
        try:
            for s in swarms:
                assert s.stdout.readline().strip() == "ready", "a swarm process failed to connect"
            out = workdir / "coordinator.json"
            worker = subprocess.run([sys.executable, __file__, "_coordinator", "--port", str(broker.port),
                                     f"--password={password}", "--size", str(size), "--rounds", str(rounds),
                                     "--state", str(workdir / "state"), "--result", str(out)],
                                    capture_output=True, text=True, timeout=1800)
            if worker.returncode != 0:
                raise RuntimeError(worker.stderr[-2000:])
            return json.loads(out.read_text())
        finally:
            for s in swarms:
                s.terminate()
            for s in swarms:
                s.wait(timeout=30)


def swarm_key(device: str) -> bytes:
    """The swarm's per-device signing keys, derived so both processes agree (bench only)."""
    return hashlib.sha256(f"edgefl-bench-swarm/{device}".encode()).digest()


def coordinator_worker(args: argparse.Namespace) -> None:
    """Runs in its own process so that its peak RSS is its own."""
    data = datasets.load("mnist5k")
    marks: dict[int, dict[str, float]] = {}

    def on_state(rnd):
        marks.setdefault(rnd.number, {})[rnd.state.value] = time.time()
        marks[rnd.number][rnd.state.value + "_cpu"] = time.process_time()

    coordinator = Engine(FED, "mnist_cnn", data.test,
                              scale_settings(args.size),
                              store=Store(args.state), on_state=on_state,
                              device_keys={f"sim-{i:04d}": swarm_key(f"sim-{i:04d}") for i in range(args.size)})
    coordinator.connect("127.0.0.1", args.port, COORDINATOR_USER, args.password, keepalive=120)
    coordinator.wait_for_devices(args.size, 600)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = []
    for r in range(1, args.rounds + 1):
        record = coordinator.run_round(r)
        m = marks[r]
        collect = m["closed"] - m["collecting"]
        cpu = m["closed_cpu"] - m["collecting_cpu"]  # this process only: paho's thread + validation + folding
        rows.append({"round": r, "participants": record.participants, "rejected": dict(record.rejected),
                     "round_s": record.seconds,
                     "collect_s": collect, "updates_per_s": record.participants / collect,
                     "updates_per_cpu_s": record.participants / cpu})
    coordinator.close()
    result = {"size": args.size, "rounds": rows,
              "round_s_median": statistics.median(r["round_s"] for r in rows),
              "updates_per_s_median": statistics.median(r["updates_per_s"] for r in rows),
              "updates_per_coordinator_cpu_s_median": statistics.median(r["updates_per_cpu_s"] for r in rows),
              "coordinator_rss_mb_after_startup": rss_before,
              "coordinator_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    Path(args.result).write_text(json.dumps(result))


def write_table(path: Path, result: dict) -> None:
    lines = ["# Runtime benchmark", "", f"Command: `{result['command']}`", ""]
    mw = result["measured_with"]
    lines += [f"Measured with the shipped defaults at {mw['commit']}: " + ", ".join(
                  f"{k} `{mw[k]}`" for k in ("algorithm", "local_epochs", "codec", "downlink", "aggregator",
                                             "weighting", "norm_bound", "mode", "topology")) + ".", "",
              "Load average (1 min) at start / end of each part: " + "; ".join(
                  f"{part} {v['start'][0]:.2f} / {v['end'][0]:.2f}" for part, v in result.get("load", {}).items() if v)
              + " (2 cores, shared with other jobs).", "",
              "Machine: {cpu}, {cores} cores; one default-codec update of the CNN decodes in {ref} ms here "
              "(`reference_decode_ms`: updates/s scales with it across hosts).".format(
                  cpu=result["machine"].get("cpu", "unknown"), cores=result["machine"]["cores"],
                  ref=(f"{result['machine']['reference_decode_ms']:.3f}"
                       if "reference_decode_ms" in result["machine"] else "(not measured)")), ""]
    epochs = sorted({e for row in result["overhead"] for r in row["rounds"] for e in r.get("epochs_chosen", [])})
    lines += ["## Orchestration overhead (real agents, MNIST CNN, each agent chooses its local epochs: "
              f"{', '.join(map(str, epochs))})", "",
              "| agents | round / slowest client training (median) | with evaluation + checkpoint | agent CPU s per round (median) |",
              "| --- | --- | --- | --- |"]
    for row in result["overhead"]:
        lines.append(f"| {row['agents']} | {row['overhead_ratio']:.3f} | {row['overhead_ratio_with_eval_and_checkpoint']:.3f} "
                     f"| {row['agent_cpu_s_per_round_median']:.2f} |")
    lines += ["", "## Scale (simulated devices, precomputed signed updates of the 80k CNN in the default codec)", "",
              f"Where this part differs from a real fleet: {mw['scale_differs']}. Updates rejected: "
              f"{sum(sum(r.get('rejected', {}).values()) for row in result['scale'] for r in row['rounds'])}.", "",
              "| devices | round completion s (median) | updates/s (median) | updates per coordinator CPU-second | coordinator peak RSS MB |",
              "| --- | --- | --- | --- | --- |"]
    for row in result["scale"]:
        lines.append(f"| {row['size']} | {row['round_s_median']:.2f} | {row['updates_per_s_median']:.0f} "
                     f"| {row['updates_per_coordinator_cpu_s_median']:.0f} | {row['coordinator_peak_rss_mb']:.0f} |")
    fp = result["agent_footprint"]
    lines += ["", "## Agent footprint (one torch thread, MNIST CNN)", "",
              f"Peak agent RSS (median over agents) {fp['agent_peak_rss_mb']:.0f} MB; bare `import torch` "
              f"{fp['bare_torch_rss_mb']:.0f} MB; ratio **{fp['agent_rss_ratio']:.2f}** (target <= 1.3).", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="all", choices=["all", "_coordinator"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["overhead", "scale"], help="run one part; the other is kept from the last results")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--port", type=int)
    parser.add_argument("--password")
    parser.add_argument("--size", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state")
    parser.add_argument("--result")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every `finally` stops the broker and swarm processes it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.mode == "_coordinator":
        coordinator_worker(args)
        return
    agent_counts = [10] if args.quick else [10, 50]
    sizes = [100, 300] if args.quick else [100, 300, 1000]
    rounds = 3 if args.quick else 5
    previous_path = args.out / "runtime.json"
    previous = json.loads(previous_path.read_text()) if args.only and previous_path.exists() else {}
    load: dict[str, dict | None] = {}  # os.getloadavg() (1, 5, 15 min) at the start and end of each part
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-") as tmp:
        if args.only == "scale" and previous:
            bare = previous["agent_footprint"]["bare_torch_rss_mb"] * 2**20
            overhead = previous["overhead"]
            load.update({k: v for k, v in previous.get("load", {}).items() if k == "overhead"})
        else:
            start = os.getloadavg()
            bare = bare_torch_rss()
            overhead = [overhead_run(n, rounds, Path(tmp) / f"overhead-{n}") for n in agent_counts]
            load["overhead"] = {"start": start, "end": os.getloadavg()}
        for row in overhead:
            print(f"{row['agents']} agents: overhead ratio {row['overhead_ratio']:.3f}", flush=True)
        if args.only == "overhead" and previous:
            scale = previous["scale"]
            load.update({k: v for k, v in previous.get("load", {}).items() if k.startswith("scale")})
        else:
            scale = []
            for n in sizes:
                start = os.getloadavg()
                scale.append(scale_run(n, SCALE_ROUNDS, Path(tmp) / f"scale-{n}"))
                load[f"scale-{n}"] = {"start": start, "end": os.getloadavg()}
        for row in scale:
            print(f"{row['size']} devices: {row['updates_per_s_median']:.0f} updates/s, "
                  f"peak RSS {row['coordinator_peak_rss_mb']:.0f} MB", flush=True)
    ten = overhead[0]
    agent_peak = statistics.median(ten["agent_peak_rss_mb"])
    result = {
        "command": "python bench/runtime.py" + (" --quick" if args.quick else "")
                   + (f" --only {args.only}" if args.only else ""),
        "machine": {"cores": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30),
                    "cpu": cpu_model(), "reference_decode_ms": reference_decode_ms()},
        "overhead_ratio": {str(r["agents"]): r["overhead_ratio"] for r in overhead},
        "updates_per_s": {str(r["size"]): r["updates_per_s_median"] for r in scale},
        "coordinator_rss_mb": {str(r["size"]): r["coordinator_peak_rss_mb"] for r in scale},
        "agent_rss_ratio": agent_peak / (bare / 2**20),
        "agent_footprint": {"agent_peak_rss_mb": agent_peak, "bare_torch_rss_mb": bare / 2**20,
                            "agent_rss_ratio": agent_peak / (bare / 2**20),
                            "agent_cpu_s_per_round": ten["agent_cpu_s_per_round_median"]},
        "load": load, "overhead": overhead, "scale": scale,
    }
    result["measured_with"] = provenance.measured_with(
        result["command"], provenance.deciding(OVERHEAD_SETTINGS), data="mnist5k",
        partition="dirichlet:0.3 (overhead runs); the scale runs send precomputed signed updates",
        describes="defaults",
        scale_differs=SWARM_DIFFERS,
        note="every part uses RoundSettings() (the shipped defaults); the overhead runs' agents choose their "
             "own local epochs; the machine's 2 cores are shared with other jobs: load averages under 'load'")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtime.json").write_text(json.dumps(result, indent=2) + "\n")
    write_table(args.out / "runtime.md", result)
    print((args.out / "runtime.md").read_text())


if __name__ == "__main__":
    main()
