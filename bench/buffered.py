"""Buffered asynchronous mode against synchronous rounds (a benchmark, not a test): accuracy against
wall-clock time on the same emulated mixed fleet, same data, same algorithm.

Real `broker-coordinator simulate` processes (private Mosquitto, one agent
process per device under its class's CPU quota) on MNIST-5k, Dirichlet 0.3
over 8 agents, FedAvg (the default DynSAM keeps a dual that buffered mode
refuses), one fixed local epoch per task (device-chosen epochs would shrink
the slow devices' work to the deadline and hide the speed spread), the default
uplink codec. The fleet is `zero2w:4,pi4:4`: speeds 0.11 and 0.40 (a 3.6x spread,
the nearest to 4x that fleet.py's classes give), with the CPU quotas scaled
down (`--fleet-cpu`) so that even a loaded host can grant them.

- sync: every device every round, a deadline long enough that a round waits
  for the slowest device (the straggler cost the buffered mode removes);
- buffered: every idle device gets a task at once; a version every K = 4
  accepted updates; updates up to S versions old accepted with 1/sqrt(1+s).

Wall-clock starts when every agent is online (history `elapsed`). The report
gives both curves (seconds -> accuracy), the time each run first reached the
sync run's final accuracy, and the task time per device class measured in the
runs (the spread the loaded host really gave).

    python -m bench.buffered              # runs what is not cached, then the report
    python -m bench.buffered --report     # the report from cached runs

Runs are cached in bench/results/buffered_runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "buffered_runs"
AGENTS = 8
FLEET = "zero2w:4,pi4:4"
FLEET_CPU = 0.25  # pi5-class quota in cores: pi4 0.10, zero2w 0.0275
SYNC_ROUNDS = 20
BUFFER, STALENESS = 4, 8
VERSIONS = 120  # buffered versions: about the sync run's wall-clock at this fleet's update rate
COMMON = ["--agents", str(AGENTS), "--dataset", "mnist5k", "--partition", "dirichlet:0.3", "--algorithm", "fedavg",
          "--local-epochs", "1", "--fleet", FLEET, "--fleet-cpu", str(FLEET_CPU), "--round-timeout", "120"]
MODES = {
    "sync": ["--mode", "sync", "--rounds", str(SYNC_ROUNDS)],
    "buffered": ["--mode", "buffered", "--rounds", str(VERSIONS), "--buffer-size", str(BUFFER),
                 "--max-staleness", str(STALENESS), "--staleness-weight", "inverse_sqrt"],
}


def run_one(mode: str, seed: int) -> dict:
    path = RUNS / f"{mode}_seed{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="edgefl-buffered-") as tmp:
        out = Path(tmp) / "out"
        args = [sys.executable, "-m", "broker_coordinator", "simulate", *COMMON, *MODES[mode], "--seed", str(seed),
                "--federation", f"buf{seed}", "--out", str(out)]
        RUNS.mkdir(parents=True, exist_ok=True)
        (RUNS / "logs").mkdir(exist_ok=True)
        log_path = RUNS / "logs" / f"{mode}_seed{seed}.log"  # raw run log: stays local (gitignored)
        started, load_before = time.time(), os.getloadavg()[0]
        print(f"[{time.strftime('%H:%M:%S')}] {mode} seed {seed}: {' '.join(args[3:])}", flush=True)
        with open(log_path, "w") as log:
            result = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
        if result.returncode != 0:
            raise RuntimeError(f"{mode} seed {seed} failed (exit {result.returncode}); see {log_path}")
        history = json.loads((out / "history.json").read_text())
    record = {**history, "wall_seconds": time.time() - started, "command": ["simulate", *COMMON, *MODES[mode],
                                                                             "--seed", str(seed)],
              "load1": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    path.write_text(json.dumps(record) + "\n")
    return record


def curve(record: dict) -> list[tuple[float, float]]:
    return [(r["elapsed"], 100 * r["accuracy"]) for r in record["rounds"]]


def first_reach(points: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, a in points if a >= target), None)


def task_seconds(record: dict) -> dict[str, float]:
    """Median local training seconds per device class (from the devices' reported metrics)."""
    classes = record["meta"].get("device_classes", {})
    by_class: dict[str, list[float]] = {}
    for r in record["rounds"]:
        for device, m in r["devices"].items():
            if "train_seconds" in m:
                by_class.setdefault(classes.get(device, "?"), []).append(float(m["train_seconds"]) /
                                                                         max(1, int(m.get("num_samples", 1))))
    return {k: round(1000 * statistics.median(v), 3) for k, v in sorted(by_class.items())}  # ms per sample


def report(seed: int) -> dict:
    runs = {mode: run_one(mode, seed) if (RUNS / f"{mode}_seed{seed}.json").exists() else None for mode in MODES}
    if any(r is None for r in runs.values()):
        raise SystemExit(f"missing runs in {RUNS}: run python -m bench.buffered first")
    curves = {mode: curve(r) for mode, r in runs.items()}
    target = curves["sync"][-1][1]
    reach = {mode: first_reach(points, target) for mode, points in curves.items()}
    sync_end = curves["sync"][-1][0]
    at_sync_end = max((a for t, a in curves["buffered"] if t <= sync_end), default=None)
    stale = [m.get("staleness", 0) for r in runs["buffered"]["rounds"] for m in r["devices"].values()]
    dropped = sum(r["rejected"].get("too_stale", 0) for r in runs["buffered"]["rounds"])
    per_sample = {mode: task_seconds(r) for mode, r in runs.items()}
    result = {
        "target": "buffered reaches the sync run's final accuracy in less wall-clock time (4x speed spread)",
        "sync_final_accuracy": round(target, 2),
        "seconds_to_sync_final": {m: (round(v, 1) if v is not None else None) for m, v in reach.items()},
        "speedup": round(reach["sync"] / reach["buffered"], 2) if reach["buffered"] and reach["sync"] else None,
        "met": reach["buffered"] is not None and reach["sync"] is not None and reach["buffered"] < reach["sync"],
        "buffered_best_by_sync_end": round(at_sync_end, 2) if at_sync_end is not None else None,
        "final_accuracy": {m: round(c[-1][1], 2) for m, c in curves.items()},
        "wall_seconds": {m: round(c[-1][0], 1) for m, c in curves.items()},
        "updates": {m: sum(r["participants"] for r in runs[m]["rounds"]) for m in MODES},
        "versions": {m: len(runs[m]["rounds"]) for m in MODES},
        "buffered_staleness": {"median": statistics.median(stale) if stale else None, "max": max(stale, default=None),
                               "dropped_too_stale": dropped},
        "ms_per_sample_by_class": per_sample,
        "curves": {m: [[round(t, 2), round(a, 2)] for t, a in c] for m, c in curves.items()},
        "meta": {"seed": seed, "seeds_note": "one seed (the shared 2 cores fit no more)", "fleet": FLEET,
                 "fleet_cpu": FLEET_CPU, "spread": "zero2w 0.11 vs pi4 0.40: 3.6x", "agents": AGENTS,
                 "commands": {m: r["command"] for m, r in runs.items()},
                 "load1": {m: r.get("load1") for m, r in runs.items()},
                 "buffer_size": BUFFER, "max_staleness": STALENESS, "staleness_weight": "inverse_sqrt"},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "buffered.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "buffered.md").write_text(markdown(result))
    plot(result, RESULTS / "buffered.png")
    return result


def markdown(r: dict) -> str:
    def cell(v: float | None) -> str:
        return "not reached" if v is None else f"{v:.1f} s"
    spread = {m: v for m, v in r["ms_per_sample_by_class"].items()}
    lines = [
        "# Buffered asynchronous mode vs synchronous rounds",
        "",
        f"Measured by `python -m bench.buffered` (seed {r['meta']['seed']} only: {r['meta']['seeds_note']}). "
        f"FedAvg on MNIST-5k, Dirichlet 0.3 over {r['meta']['agents']} agents, one local epoch per task, fleet "
        f"`{r['meta']['fleet']}` ({r['meta']['spread']}; `--fleet-cpu {r['meta']['fleet_cpu']}`). Buffered: "
        f"K = {r['meta']['buffer_size']}, S = {r['meta']['max_staleness']}, weight 1/sqrt(1+s). Clock from all "
        "agents online.",
        "",
        "| mode | versions | updates | wall s | final acc | time to sync's final "
        f"({r['sync_final_accuracy']:.2f}%) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in ("sync", "buffered"):
        lines.append(f"| {m} | {r['versions'][m]} | {r['updates'][m]} | {r['wall_seconds'][m]:.0f} | "
                     f"{r['final_accuracy'][m]:.2f} | {cell(r['seconds_to_sync_final'][m])} |")
    verdict = "met" if r["met"] else "NOT met"
    lines += [
        "",
        f"Target (buffered reaches the sync run's final accuracy in less wall-clock time): **{verdict}**"
        + (f", {r['speedup']}x sooner." if r["speedup"] else "."),
        f"Best buffered accuracy by the time the sync run ended: {r['buffered_best_by_sync_end']}%.",
        f"Buffered staleness of folded updates: median {r['buffered_staleness']['median']}, max "
        f"{r['buffered_staleness']['max']}; dropped as too stale: {r['buffered_staleness']['dropped_too_stale']}.",
        "",
        "Local training time per sample by class (ms, median; the spread the loaded host actually gave): "
        + "; ".join(f"{m}: " + ", ".join(f"{k} {v}" for k, v in c.items()) for m, c in spread.items()) + ".",
        f"Load average (1 min) before/after: {r['meta']['load1']}.",
        "",
    ]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, points in r["curves"].items():
        ax.plot([t for t, _ in points], [a for _, a in points], marker="o" if mode == "sync" else None,
                markersize=3, label=mode)
    ax.axhline(r["sync_final_accuracy"], color="grey", linestyle=":", label="sync final")
    ax.set_xlabel("wall-clock seconds (all agents online = 0)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"FedAvg, {r['meta']['fleet']} ({r['meta']['spread']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", action="store_true", help="rebuild the report from cached runs only")
    args = parser.parse_args(argv)
    if not args.report:
        for mode in MODES:
            run_one(mode, args.seed)
    r = report(args.seed)
    print((RESULTS / "buffered.md").read_text())
    return 0 if r["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
