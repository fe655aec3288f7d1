"""Field benchmark (a benchmark, not a test): every algorithm the way devices run it.

Real `broker-coordinator simulate` processes (private Mosquitto, one agent
process per device) on the headline partition (bench/data, MNIST-5k,
Dirichlet 0.1, 20 clients, 10 per round), on an emulated mixed fleet
(`--fleet zero2w:4,pi3:4,pi4:8,pi5:4`: each agent under a real CPU quota and
memory limit), the default codecs both ways (uplink topk0.1+q4c64+zlib,
downlink float32), device-chosen epochs (`--local-epochs 0`), a deadline the
slowest class must shrink its work to meet, and churn (devices stopped or
frozen for random periods from the seed).

    python -m bench.field --quick              # a smoke version, under 5 minutes
    python -m bench.field                      # the matrix, in priority order (CPU-hours on 2 cores)
    python -m bench.field --only dynsam+sgd,fedavg+sgd --seeds 1,2
    python -m bench.field --codec-cost         # the default candidate with float32 updates too
    python -m bench.field --report             # rebuild field.json/md/png from cached runs

Every finished run is cached in bench/results/field_runs/<row>/seed<N>.json
(history and settings; resumable: a cached run is never repeated). The report
writes bench/results/field.json (the issue's schema), field.md and field.png;
--quick writes field_quick.* beside them.
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

from . import provenance

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "field_runs"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
PARTITION_FILE = PROJECT_ROOT / "bench" / "data" / "mnist5k_dir01_20clients.npz"
FLEET = "zero2w:4,pi3:4,pi4:8,pi5:4"
CHURN = "0.1:20"  # about 10% of devices offline at a time, 20 s per outage on average
DEADLINE = 8.0  # seconds: on an idle host about 5 epochs fit a pi5-class quota, fewer than 3 a zero2w's
AGENTS, PER_ROUND, ROUNDS = 20, 10, 40
MOMENTUM = 0.9
ALGORITHMS = {  # row -> (algorithm, hparams)
    "fedavg": ("fedavg", {}),
    "fedprox": ("fedprox", {}),
    "feddyn": ("feddyn", {}),
    "fedsmoo": ("fedsmoo", {"sam_every": 4}),  # CPU-sized
    "drsam": ("drsam", {"sam_every": 4}),  # CPU-sized
    "dynsam": ("dynsam", {}),  # CPU-sized by default (sam_every 4)
}
# the order the runs are made in: the rows that decide the default first, seed 1 of everything first
PRIORITY = ["fedavg+sgd", "dynsam+sgd", "dynsam+momentum", "fedavg+momentum", "feddyn+momentum",
            "fedsmoo+momentum", "feddyn+sgd", "fedsmoo+sgd", "fedprox+sgd", "fedprox+momentum", "drsam+sgd",
            "drsam+momentum"]
QUICK_ROWS = ["fedavg+sgd", "dynsam+sgd"]


def row_parts(row: str) -> tuple[str, dict, float]:
    name, _, optimizer = row.partition("+")
    if name not in ALGORITHMS or optimizer not in ("sgd", "momentum"):
        raise SystemExit(f"unknown row {row!r}: write ALGORITHM+sgd or ALGORITHM+momentum, "
                         f"ALGORITHM one of {', '.join(ALGORITHMS)}")
    algorithm, hparams = ALGORITHMS[name]
    return algorithm, hparams, MOMENTUM if optimizer == "momentum" else 0.0


def cache_path(row: str, seed: int, rounds: int, codec: str | None, runs: Path) -> Path:
    suffix = "" if codec is None else f"_{codec.replace('+', '-')}"
    return runs / f"{row}{suffix}" / f"seed{seed}_r{rounds}.json"


def run_simulate(args: list[str], out: Path, path: Path, log_path: Path, label: str, timeout: float) -> dict:
    """Run one `simulate` command (`args`, writing into `out`), log its output to `log_path`, and cache its
    history at `path` with the wall time, the load average and the command as anyone can rerun it from the
    project root (no paths of this machine)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()[0]
    print(f"[{time.strftime('%H:%M:%S')}] {label}", flush=True)
    with open(log_path, "w") as log:
        result = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=PROJECT_ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{label}: simulate failed (exit {result.returncode}); see {log_path}")
    history = json.loads((out / "history.json").read_text())
    portable = [str(PARTITION_FILE.relative_to(PROJECT_ROOT)) if a == str(PARTITION_FILE) else
                "OUT" if a == str(out) else a for a in args[1:]]
    record = {**history, "wall_seconds": time.time() - started, "command": portable,
              "load1": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) + "\n")
    return record


def run_one(row: str, seed: int, rounds: int, codec: str | None, runs: Path, log_dir: Path) -> dict:
    """One simulate run (cached): returns {"meta", "rounds", "wall_seconds", "command", "load"}."""
    path = cache_path(row, seed, rounds, codec, runs)
    if path.exists():
        return json.loads(path.read_text())
    algorithm, hparams, momentum = row_parts(row)
    with tempfile.TemporaryDirectory(prefix="edgefl-field-") as tmp:
        out = Path(tmp) / "out"
        args = [sys.executable, "-m", "broker_coordinator", "simulate", "--agents", str(AGENTS),
                "--rounds", str(rounds), "--dataset", "mnist5k", "--partition-file", str(PARTITION_FILE),
                "--clients-per-round", str(PER_ROUND), "--algorithm", algorithm, "--momentum", str(momentum),
                "--local-epochs", "0", "--round-timeout", str(DEADLINE), "--fleet", FLEET, "--churn", CHURN,
                "--seed", str(seed), "--federation", f"field{seed}", "--out", str(out)]
        for key, value in hparams.items():
            args += ["--hparam", f"{key}={value}"]
        if codec:
            args += ["--codec", codec]
        log_path = log_dir / f"{path.parent.name}_seed{seed}_r{rounds}.log"
        label = f"{row} seed {seed}{' ' + codec if codec else ''}: {' '.join(args[1:])}"
        record = run_simulate(args, out, path, log_path, label, timeout=rounds * 120 + 900)
    accuracies = [r["accuracy"] for r in record["rounds"]]
    print(f"    final {100 * accuracies[-1]:.2f}%, best {100 * max(accuracies):.2f}%, "
          f"{record['wall_seconds']:.0f} s", flush=True)
    return record


# --- the report ------------------------------------------------------------------------

def model_download_bytes(algorithm: str, model_codec: str = "float32") -> int:
    """Bytes of one model release (what a device fetches per round it takes part in), with the
    algorithm's broadcast tensors (FedSMOO's s); the manifest and MQTT framing are not counted."""
    from edgefl_protocol import algorithms, downlink
    from models.architectures import build_model, get_weights
    weights = get_weights(build_model("mnist_cnn", 0))
    server = algorithms.get(algorithm).server(algorithms.get(algorithm).defaults)
    extras = {}
    if server.extra_specs({n: a.shape for n, a in weights.items()}):
        import numpy as np
        extras = {f"extra.s.{n}": np.zeros_like(a) for n, a in weights.items()}  # same shapes as the model
    if algorithm == "dynsam" and float(server.hparams.get("global_perturbation", 0)) == 0:
        extras = {}
    _, chunks = downlink.release(1, "mnist_cnn", {**weights, **extras}, model_codec)
    return sum(len(c) for c in chunks)


def run_stats(record: dict) -> dict:
    rounds = record["rounds"]
    accuracy = [100 * r["accuracy"] for r in rounds]
    best = max(accuracy)
    selected = sum(r["selected"] for r in rounds)
    participants = sum(r["participants"] for r in rounds)
    devices = [d for r in rounds for d in r["devices"].values()]
    by_class: dict[str, dict[str, float]] = {}
    for r in rounds:
        for device in r.get("cohort", []):
            klass = record["meta"].get("device_classes", {}).get(device, "?")
            c = by_class.setdefault(klass, {"selected": 0, "answered": 0, "epochs": 0})
            c["selected"] += 1
            if device in r["devices"]:
                c["answered"] += 1
                c["epochs"] += r["devices"][device].get("epochs", 0)
    return {
        "final": accuracy[-1], "best": best,
        "rounds_to_90": next(i + 1 for i, a in enumerate(accuracy) if a >= 0.9 * best),
        "bytes_up_per_update": sum(r["bytes_up"] for r in rounds) / max(participants, 1),
        "passes": statistics.mean(d.get("passes", 0) for d in devices) if devices else 0.0,
        "epochs": statistics.mean(d.get("epochs", 0) for d in devices) if devices else 0.0,
        "round_seconds": statistics.mean(r["seconds"] for r in rounds),
        "late_fraction": 1 - participants / max(selected, 1),
        "by_class": {k: {"late_fraction": 1 - v["answered"] / max(v["selected"], 1),
                         "epochs": v["epochs"] / max(v["answered"], 1)} for k, v in sorted(by_class.items())},
        "curve": accuracy, "wall_seconds": record.get("wall_seconds"), "load1": record.get("load1"),
        "churn_outages": len(record["meta"].get("churn_events", [])),
        "fleet_limits": record["meta"].get("fleet_limits"),
    }


def load_runs(runs: Path, rounds: int) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for path in sorted(runs.glob(f"*/seed*_r{rounds}.json")):
        seed = int(path.stem.split("_")[0][4:])
        out.setdefault(path.parent.name, {})[seed] = run_stats(json.loads(path.read_text()))
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def report(runs: Path, rounds: int, stem: str) -> dict:
    from edgefl_protocol import algorithms, codec
    from broker_coordinator.engine.coordinator import RoundSettings
    table = load_runs(runs, rounds)
    rows = {row: seeds for row, seeds in table.items() if "_" not in row}
    passes_ref = {opt: mean([s["passes"] for s in rows.get(f"fedavg+{opt}", {}).values()]) for opt in ("sgd", "momentum")}
    out_runs, details = {}, {}
    for row, seeds in sorted(rows.items()):
        ordered = [seeds[k] for k in sorted(seeds)]
        optimizer = row.partition("+")[2]
        ref = passes_ref.get(optimizer, float("nan"))
        out_runs[row] = {
            "final_accuracy": [round(s["final"], 2) for s in ordered],
            "best_accuracy": [round(s["best"], 2) for s in ordered],
            "seeds": sorted(seeds),
            "rounds_to_90pct_of_best": [s["rounds_to_90"] for s in ordered],
            "bytes_up_per_update": round(mean([s["bytes_up_per_update"] for s in ordered])),
            "bytes_down_per_update": model_download_bytes(row_parts(row)[0]),
            "passes_ratio": round(mean([s["passes"] for s in ordered]) / ref, 3) if ref == ref and ref else None,
            "late_fraction": round(mean([s["late_fraction"] for s in ordered]), 3),
            "round_seconds": round(mean([s["round_seconds"] for s in ordered]), 2),
            "epochs": round(mean([s["epochs"] for s in ordered]), 2),
        }
        details[row] = {str(k): {key: v for key, v in seeds[k].items()} for k in sorted(seeds)}
    codec_cost = {}
    for row, seeds in table.items():
        base, _, codec_name = row.partition("_")
        if codec_name and base in rows:
            paired = sorted(set(seeds) & set(rows[base]))
            if paired:
                codec_cost[base] = {
                    "points": round(mean([seeds[k]["final"] - rows[base][k]["final"] for k in paired]), 2),
                    "seeds": paired, "lossless_codec": codec_name.replace("-", "+"),
                    "bytes_up_per_update_lossless": round(mean([seeds[k]["bytes_up_per_update"] for k in paired]))}
    settings = RoundSettings()
    default = {"algorithm": settings.algorithm, "optimizer": "momentum" if settings.momentum else "sgd",
               "codec": settings.codec, "local_epochs": settings.local_epochs}
    result = {"default": default, "runs": out_runs,
              "codec_cost": {row: v["points"] for row, v in codec_cost.items()},
              "codec_cost_details": codec_cost,
              "meta": {"fleet": FLEET, "churn": CHURN, "deadline_s": DEADLINE, "agents": AGENTS,
                       "clients_per_round": PER_ROUND, "rounds": rounds, "partition": PARTITION_FILE.name,
                       "uplink_codec": codec.DEFAULT, "downlink_codec": "float32", "local_epochs": 0,
                       "algorithms": {n: {"algorithm": a, "hparams": {**algorithms.get(a).defaults, **h}}
                                      for n, (a, h) in ALGORITHMS.items()}}}
    result["measured_with"] = provenance.measured_with(
        provenance.invoked(), {k: v for k, v in provenance.deciding(settings).items()
                               if k not in ("algorithm", "momentum")},
        local_epochs=0, varies={"algorithm": "per row", "momentum": [0.0, MOMENTUM]}, data="mnist5k",
        partition=f"bench/data/{PARTITION_FILE.name}", seeds_per_row={row: r["seeds"] for row, r in out_runs.items()},
        runs=f"cached in {os.path.relpath(runs, PROJECT_ROOT)}/: a cached run may come from older code than this commit")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{stem}_details.json").write_text(
        json.dumps({**details, "measured_with": result["measured_with"]}) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(result, details))
    plot(details, RESULTS / f"{stem}.png", rounds)
    return result


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{mean(values):.2f} +- {statistics.stdev(values):.2f}"


def winner(result: dict, max_passes: float = 1.3) -> tuple[str | None, str]:
    """The row with the best mean final accuracy within max_passes x FedAvg's passes."""
    runs = result["runs"]
    eligible = {r: v for r, v in runs.items() if v["passes_ratio"] is not None and v["passes_ratio"] <= max_passes}
    if not eligible:
        return None, "no row has a passes ratio yet"
    best = max(eligible, key=lambda r: mean(eligible[r]["final_accuracy"]))
    return best, f"{best}: {mean(eligible[best]['final_accuracy']):.2f} over {len(eligible[best]['seeds'])} seed(s)"


def targets(result: dict) -> list[str]:
    """The issue's targets for the runtime default, from the rows measured so far (seeds paired where
    a comparison is between rows)."""
    runs, d = result["runs"], result["default"]
    row = f"{d['algorithm']}+{d['optimizer']}"
    if row not in runs:
        return ["", f"Targets: the default row {row} has no runs yet."]
    v = runs[row]
    mine = dict(zip(v["seeds"], v["final_accuracy"]))

    def paired(other: str) -> tuple[float, list[int]]:
        theirs = dict(zip(runs[other]["seeds"], runs[other]["final_accuracy"]))
        common = sorted(set(mine) & set(theirs))
        return (mean([mine[k] - theirs[k] for k in common]), common) if common else (float("nan"), [])

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    lines = ["", f"Targets for the default `{row}` (paired by seed; n = seeds compared):", ""]
    ref = f"fedavg+{d['optimizer']}"
    if ref in runs:
        gap, common = paired(ref)
        lines.append(f"- vs {ref}: {gap:+.2f} points (n = {len(common)}; target >= +2.0): {verdict(gap >= 2.0)}")
    others = [r for r in runs if r != row]
    if others:
        gaps = {r: paired(r) for r in others if paired(r)[1]}
        worst = min(gaps, key=lambda r: gaps[r][0]) if gaps else None
        if worst:
            gap, common = gaps[worst]
            lines.append(f"- vs the best other row on the same seeds, {worst}: {gap:+.2f} points (n = {len(common)}; "
                         f"target >= -0.2, moonshot >= +0.5): {verdict(gap >= -0.2)}")
    cost = result["codec_cost"].get(row)
    if cost is not None:
        lines.append(f"- codec cost: {cost:+.2f} points lost to the lossy uplink vs float32 (negative: none lost; "
                     f"target <= 0.3): {verdict(cost <= 0.3)}")
    else:
        lines.append("- codec cost: not measured yet for this row")
    worst_gap = min(f - b for f, b in zip(v["final_accuracy"], v["best_accuracy"]))
    lines.append(f"- final vs its own best, worst seed: {worst_gap:+.2f} (target >= -0.5 in every seed): "
                 f"{verdict(worst_gap >= -0.5)}")
    up = v["bytes_up_per_update"] / 1024
    lines.append(f"- upload: {up:.1f} KB per update (target <= 16 KB): {verdict(up <= 16)}")
    return lines


def markdown(result: dict, details: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Field benchmark",
        "",
        f"`python -m bench.field` (bench/field.py). Real `broker-coordinator simulate` processes: "
        f"{meta['agents']} agents on the partition `bench/data/{meta['partition']}` (MNIST-5k, Dirichlet 0.1), "
        f"{meta['clients_per_round']} per round, {meta['rounds']} rounds; fleet `{meta['fleet']}` (each agent "
        f"under a cgroup CPU quota and memory limit, broker_coordinator/simulation/fleet.py), churn `{meta['churn']}`, "
        f"deadline {meta['deadline_s']:.0f} s, device-chosen epochs, uplink `{meta['uplink_codec']}`, downlink "
        f"`{meta['downlink_codec']}`. Accuracy in %, mean +- std over the seeds listed; a single seed is "
        "shown bare. \"passes\" is forward-backward passes per client-round relative to FedAvg with the same "
        "optimizer; \"late/offline\" is the share of selected devices whose update did not count (late, "
        "stopped or frozen). Other engineers' jobs shared the 2 cores: round times include that load "
        "(load average before/after each run is in field_details.json).",
        "",
        "| row | seeds | final accuracy | best accuracy | final - best (worst seed) | rounds to 90% of best "
        "| up KB / update | down KB / update | passes vs fedavg | epochs / client-round | round s "
        "| late/offline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(result["runs"], key=lambda r: -mean(result["runs"][r]["final_accuracy"]))
    for row in order:
        v = result["runs"][row]
        gap = min(f - b for f, b in zip(v["final_accuracy"], v["best_accuracy"]))
        passes = "-" if v["passes_ratio"] is None else f"{v['passes_ratio']:.2f}x"
        lines.append(
            f"| {row} | {','.join(map(str, v['seeds']))} | {_fmt(v['final_accuracy'])} | {_fmt(v['best_accuracy'])} "
            f"| {gap:.2f} | {mean(v['rounds_to_90pct_of_best']):.0f} | {v['bytes_up_per_update'] / 1024:.1f} "
            f"| {v['bytes_down_per_update'] / 1024:.0f} "
            f"| {passes} "
            f"| {v['epochs']:.2f} | {v['round_seconds']:.1f} | {100 * v['late_fraction']:.1f}% |")
    lines += ["", "Per device class (mean over the row's seeds): share of selected devices whose update did not "
              "count, and epochs per counted client-round.", "",
              "| row | " + " | ".join(f"{c} late" for c in ("zero2w", "pi3", "pi4", "pi5")) + " | "
              + " | ".join(f"{c} epochs" for c in ("zero2w", "pi3", "pi4", "pi5")) + " |",
              "|---|" + "---|" * 8]
    for row in order:
        seeds = details[row].values()
        late = [mean([s["by_class"].get(c, {}).get("late_fraction", float("nan")) for s in seeds]) for c in
                ("zero2w", "pi3", "pi4", "pi5")]
        epochs = [mean([s["by_class"].get(c, {}).get("epochs", float("nan")) for s in seeds]) for c in
                  ("zero2w", "pi3", "pi4", "pi5")]
        lines.append(f"| {row} | " + " | ".join(f"{100 * x:.0f}%" for x in late) + " | "
                     + " | ".join(f"{x:.1f}" for x in epochs) + " |")
    if result["codec_cost_details"]:
        lines += ["", "Codec cost: final accuracy with the default lossy uplink minus with lossless updates, "
                  "paired by seed (negative: the lossy codec loses points).", ""]
        for row, v in result["codec_cost_details"].items():
            up = result["runs"][row]["bytes_up_per_update"]
            lines.append(f"- {row}: {-v['points']:+.2f} points with `{meta['uplink_codec']}` vs `{v['lossless_codec']}` "
                         f"(seeds {','.join(map(str, v['seeds']))}); upload {up / 1024:.1f} KB vs "
                         f"{v['bytes_up_per_update_lossless'] / 1024:.1f} KB per update")
    loads = [x for seeds in details.values() for run in seeds.values() for x in (run.get("load1") or [])]
    if loads:
        lines += ["", f"Host load while the runs ran (1-minute load average on 2 cores, at each run's start and "
                      f"end): median {statistics.median(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f}. "
                      "The CPU quotas are ceilings: under this load the agents got less than their quota, "
                      "so the fast classes measured lower speeds and chose fewer epochs than on an idle host."]
    lines += targets(result)
    best, why = winner(result)
    lines += ["", f"Best row within 1.3x FedAvg's passes: {why}.",
              f"Runtime default (RoundSettings): `{result['default']['algorithm']}`, "
              f"{result['default']['optimizer']}, `{result['default']['codec']}`, local_epochs "
              f"{result['default']['local_epochs']}.", ""]
    return "\n".join(lines)


def plot(details: dict, path: Path, rounds: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    names = sorted({row.partition("+")[0] for row in details})
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    for ax, first in zip(axes, (1, max(1, rounds // 2))):
        for row, seeds in sorted(details.items()):
            curves = [s["curve"] for s in seeds.values()]
            n = min(len(c) for c in curves)
            name, _, optimizer = row.partition("+")
            xs = list(range(first, n + 1))
            ax.plot(xs, [statistics.median(c[i - 1] for c in curves) for i in xs], color=colors[name],
                    linestyle="-" if optimizer == "sgd" else "--",
                    label=f"{row} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%), median over seeds")
    axes[1].set_title(f"rounds {max(1, rounds // 2)}-{rounds}")
    axes[1].set_ylim(85, 98)
    axes[0].set_title(f"field: {FLEET}, churn {CHURN}, deadline {DEADLINE:.0f} s")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fedavg+sgd and dynsam+sgd, 1 seed, 5 rounds")
    parser.add_argument("--only", default="", help="comma-separated rows, e.g. dynsam+sgd,fedavg+momentum")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default 1,2,3)")
    parser.add_argument("--rounds", type=int, default=0, help=f"rounds per run (default {ROUNDS}; quick 5)")
    parser.add_argument("--codec-cost", default="", metavar="ROWS",
                        help="also run these rows with float32 updates (the codec cost), e.g. dynsam+sgd")
    parser.add_argument("--report", action="store_true", help="only rebuild the report from cached runs")
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else ROUNDS)
    stem = "field_quick" if args.quick else "field"
    runs = RESULTS / (f"{stem}_runs")
    rows = [r for r in args.only.split(",") if r] or (QUICK_ROWS if args.quick else PRIORITY)
    seeds = [1] if args.quick else [int(s) for s in args.seeds.split(",") if s]
    for row in rows + [r for r in args.codec_cost.split(",") if r]:
        row_parts(row)
    if not args.report:
        plan = [(seed, row, None) for seed in seeds for row in rows]
        plan += [(seed, row, "float32") for seed in seeds for row in args.codec_cost.split(",") if row]
        plan.sort(key=lambda p: p[0])  # seed 1 of everything before seed 2
        for seed, row, codec in plan:
            try:
                run_one(row, seed, rounds, codec, runs, runs / "logs")
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"    {exc}", flush=True)
            report(runs, rounds, stem)  # after every run: results exist whenever the job is stopped
    result = report(runs, rounds, stem)
    print((RESULTS / f"{stem}.md").read_text())
    return 0 if result["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
