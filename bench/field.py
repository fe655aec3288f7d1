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
    python -m bench.field --only dynsam+sgd+momentum,fedavg+sgd+adam@0.03   # rows with a server optimizer
    python -m bench.field --codec-cost         # the default candidate with float32 updates too
    python -m bench.field --report             # rebuild field.json/md/png from cached runs

Every finished run is cached in bench/results/field_runs/<row>/seed<N>.json
(history and settings; resumable: a cached run is never repeated). The report
writes the "fleet" part of bench/results/field.json (whose other parts bench/field_settings.py writes),
field.md and field.png;
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
from .field_report import client_optimizer, markdown, mean, plot

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


def row_parts(row: str) -> tuple[str, dict, float, str, float | None]:
    """ALGORITHM+CLIENT[+SERVER[@LR]] -> (algorithm, hparams, client momentum, server optimizer, server_lr).
    CLIENT is sgd or momentum (local SGD, or momentum 0.9); SERVER one of [rounds] server_optimizer's
    values, with its server_lr after "@" (default: the optimizer's own); no SERVER: sgd at rate 1."""
    from broker_coordinator.settings.choices import SERVER_OPTIMIZERS
    name, optimizer, server, *rest = row.split("+") + ["", ""]
    server, _, rate = server.partition("@")
    try:
        lr = float(rate) if rate else None
    except ValueError:
        lr = -1.0
    if (name not in ALGORITHMS or optimizer not in ("sgd", "momentum") or any(rest)
            or (server and server not in SERVER_OPTIMIZERS) or (lr is not None and not 0 < lr <= 10)):
        raise SystemExit(f"unknown row {row!r}: write ALGORITHM+CLIENT or ALGORITHM+CLIENT+SERVER[@LR], ALGORITHM "
                         f"one of {', '.join(ALGORITHMS)}, CLIENT sgd or momentum, SERVER one of "
                         f"{', '.join(SERVER_OPTIMIZERS)}, LR in (0, 10], e.g. dynsam+sgd+adam@0.01")
    algorithm, hparams = ALGORITHMS[name]
    return algorithm, hparams, MOMENTUM if optimizer == "momentum" else 0.0, server or "sgd", lr


def server_of(row: str) -> dict:
    """The row's server optimizer and the rate it ran at (the default rate when the row names none)."""
    from broker_coordinator.settings.round_settings import RoundSettings
    _, _, _, server, lr = row_parts(row)
    return {"server_optimizer": server,
            "server_lr": RoundSettings(server_optimizer=server, server_lr=lr).server_step_size()}


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
    algorithm, hparams, momentum, server, server_lr = row_parts(row)
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
        if row.count("+") > 1:  # a row naming its server optimizer (plain rows run, and cache, as before)
            args += ["--server-optimizer", server] + (["--server-lr", str(server_lr)] if server_lr else [])
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
    from edgefl_models.architectures import build_model, get_weights
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


def report(runs: Path, rounds: int, stem: str) -> dict:
    from edgefl_protocol import algorithms, codec
    from broker_coordinator.settings.round_settings import RoundSettings
    table = load_runs(runs, rounds)
    rows = {row: seeds for row, seeds in table.items() if "_" not in row}
    passes_ref = {opt: mean([s["passes"] for s in rows.get(f"fedavg+{opt}", {}).values()]) for opt in ("sgd", "momentum")}
    out_runs, details = {}, {}
    for row, seeds in sorted(rows.items()):
        ordered = [seeds[k] for k in sorted(seeds)]
        ref = passes_ref.get(client_optimizer(row), float("nan"))
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
            **server_of(row),
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
               "server_optimizer": settings.server_optimizer,
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
                               if k not in ("algorithm", "momentum", "server_optimizer", "server_lr")},
        local_epochs=0, varies={"algorithm": "per row", "momentum": [0.0, MOMENTUM],
                                "server_optimizer": sorted({r["server_optimizer"] for r in out_runs.values()}),
                                "server_lr": "per row"}, data="mnist5k",
        server_optimizer_per_row={row: f"{r['server_optimizer']}@{r['server_lr']:g}" for row, r in out_runs.items()},
        partition=f"bench/data/{PARTITION_FILE.name}", seeds_per_row={row: r["seeds"] for row, r in out_runs.items()},
        runs=f"cached in {os.path.relpath(runs, PROJECT_ROOT)}/: a cached run may come from older code than this commit")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{stem}.json"
    if stem == "field":  # field.json is bench/field_settings.py's; these runs are its "fleet" part
        whole = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**whole, "fleet": result}, indent=1) + "\n")
    else:
        path.write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{stem}_details.json").write_text(
        json.dumps({**details, "measured_with": result["measured_with"]}) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(result, details))
    plot(details, RESULTS / f"{stem}.png", rounds, result["meta"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fedavg+sgd and dynsam+sgd, 1 seed, 5 rounds")
    parser.add_argument("--only", default="", help="comma-separated rows ALGORITHM+CLIENT[+SERVER[@LR]], e.g. "
                        "dynsam+sgd,fedavg+momentum,dynsam+sgd+adam@0.01")
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
