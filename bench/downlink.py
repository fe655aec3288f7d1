"""Downlink benchmark (a benchmark, not a test): float32 full models vs lossy deltas, in the field.

Real `broker-coordinator simulate` runs of the default algorithm on the field
benchmark's partition, fleet, churn and deadline (bench/field.py), at a
smaller size (AGENTS agents, PER_ROUND per round, ROUNDS rounds), once with
`--downlink full` (every device fetches the float32 model) and once with
`--downlink delta` (the default: lossy deltas with server-side error feedback,
edgefl_protocol/delta_downlink.py), same seed, same settings.

Bytes are what was actually sent and received: up is the signed updates the
coordinator accepted (history `bytes_up`), down is the model messages
(manifests, chunks, deltas) each device counted as it received them and
reported with its next accepted update (history `bytes_down`). Both are divided
by the accepted client-rounds. A device's first download (what it received
while it held no model at all: joining the federation, once per device) is
counted apart (`bytes_down_join`) and reported as `down_with_first_download`:
in a 25-round run it is 20 full models spread over ~230 client-rounds, a cost
that a long-lived federation does not pay per round. Devices follow every
version, selected or not, so down per client-round is about (devices online /
participants) versions' worth.

    python -m bench.downlink                 # seed 1, both modes (about 15 minutes on a loaded host)
    python -m bench.downlink --seeds 1,2
    python -m bench.downlink --codecs topk0.1+q4c64+zlib   # also delta runs with other codecs
    python -m bench.downlink --report        # rebuild downlink.json/md from the cached runs
    python -m bench.downlink --controlled --rounds 20 --codecs topk0.1+q4c64+zlib
                                             # the same, but every device trains 2 epochs (deadline 20 s)

Device-chosen epochs follow the host's load, and on a shared 2-core host that
load moves more accuracy between two runs than the downlink does (round 1,
identical in both modes, differed by up to 8 points). `--controlled` fixes the
work per client-round (2 local epochs, a 20 s deadline), so that what differs
between the rows is the downlink; it writes downlink_controlled.json/md and
caches in downlink_controlled_runs/.

Runs are cached in bench/results/downlink_runs/<row>/seed<N>_r<R>.json, row
"full" or "delta_<codec>"; the headline delta row is RoundSettings' downlink_codec.
Writes bench/results/downlink.json and downlink.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
from pathlib import Path

from . import provenance

from bench.field import CHURN, DEADLINE, FLEET, PARTITION_FILE, run_simulate

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "downlink_runs"
CONTROLLED = {"local_epochs": 2, "deadline_s": 20.0}
STEM = "downlink"
AGENTS, PER_ROUND, ROUNDS = 20, 10, 25
MODES = ("full", "delta")
LOCAL_EPOCHS, ROUND_TIMEOUT = 0, DEADLINE  # the field's: device-chosen epochs, its deadline
TARGET_BYTES, TARGET_POINTS = 24 * 1024, 0.5
LAST = 3  # rounds averaged for the "last rounds" accuracy (less noisy than the final round alone)


def row_name(mode: str, codec: str | None) -> str:
    return mode if mode == "full" else f"{mode}_{codec.replace('+', '-')}"


def run_one(mode: str, seed: int, rounds: int, codec: str | None = None) -> dict:
    """One simulate run (cached); a delta run names its codec (default: RoundSettings')."""
    from broker_coordinator.settings.round_settings import RoundSettings
    codec = None if mode == "full" else codec or RoundSettings().downlink_codec
    row = row_name(mode, codec)
    path = RUNS / row / f"seed{seed}_r{rounds}.json"
    if path.exists():
        return json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="edgefl-downlink-") as tmp:
        out = Path(tmp) / "out"
        args = [sys.executable, "-m", "broker_coordinator", "simulate", "--agents", str(AGENTS),
                "--rounds", str(rounds), "--dataset", "mnist5k", "--partition-file", str(PARTITION_FILE),
                "--clients-per-round", str(PER_ROUND), "--local-epochs", str(LOCAL_EPOCHS),
                "--round-timeout", str(ROUND_TIMEOUT),
                "--fleet", FLEET, "--churn", CHURN, "--seed", str(seed), "--federation", f"downlink{seed}",
                "--downlink", mode, "--out", str(out)] + (["--downlink-codec", codec] if codec else [])
        return run_simulate(args, out, path, RUNS / "logs" / f"{row}_seed{seed}_r{rounds}.log",
                            f"downlink {row} seed {seed}", timeout=rounds * 120 + 900)


def run_stats(record: dict) -> dict:
    rounds = [r for r in record["rounds"] if r["closed"] != "abandoned"]
    participants = sum(r["participants"] for r in rounds)
    if any(r.get("broadcast_accuracy") is not None for r in rounds):
        # runs made while the coordinator evaluated G as `accuracy` and B beside it
        served = [100 * (r["broadcast_accuracy"] if r.get("broadcast_accuracy") is not None else r["accuracy"])
                  for r in rounds]
        ahead = [100 * r["accuracy"] for r in rounds]
    else:  # `accuracy` is the served model (B with deltas), `global_score` the server rule's G
        served = [100 * r["accuracy"] for r in rounds]
        ahead = [100 * (r["global_score"] if r.get("global_score") is not None else r["accuracy"]) for r in rounds]
    accuracy, broadcast = served, ahead
    return {
        "final_accuracy": round(accuracy[-1], 2),
        "last_accuracy": round(statistics.mean(accuracy[-LAST:]), 2),
        "best_accuracy": round(max(accuracy), 2),
        # the server rule's G, which runs ahead of B (what devices hold, served); equal with a full downlink
        "global_final_accuracy": round(broadcast[-1], 2),
        "global_last_accuracy": round(statistics.mean(broadcast[-LAST:]), 2),
        "up": round(sum(r["bytes_up"] for r in rounds) / max(participants, 1)),
        "down": round(sum(r.get("bytes_down", 0) for r in rounds) / max(participants, 1)),
        "down_with_first_download": round((sum(r.get("bytes_down", 0) for r in rounds) + sum(
            int(m.get("bytes_down_join", 0)) for r in rounds for m in r["devices"].values())) / max(participants, 1)),
        "model_via": dict(collections.Counter(m.get("model_via", "?") for r in rounds for m in r["devices"].values())),
        "client_rounds": participants,
        "rounds": len(rounds),
        "wall_seconds": round(record.get("wall_seconds") or 0),
        "load1": record.get("load1"),
        "curve": [round(a, 2) for a in accuracy],
        "global_curve": [round(a, 2) for a in broadcast],
    }


def report(rounds: int) -> dict:
    from broker_coordinator.settings.round_settings import RoundSettings
    runs = {row.name: {int(p.stem.split("_")[0][4:]): run_stats(json.loads(p.read_text()))
                       for p in sorted(row.glob(f"seed*_r{rounds}.json"))}
            for row in sorted(RUNS.iterdir()) if row.is_dir() and row.name != "logs"}
    settings = RoundSettings()
    default = row_name("delta", settings.downlink_codec)
    seeds = sorted(set(runs.get("full", {})) & set(runs.get(default, {})))
    if not seeds:
        raise SystemExit(f"no seed has both a full and a {default} run yet")

    def summary(mode: str, seeds: list[int] = seeds) -> dict:
        per_seed = [runs[mode][s] for s in seeds if s in runs[mode]]
        keys = ("final_accuracy", "last_accuracy", "best_accuracy", "global_final_accuracy",
                "global_last_accuracy", "up", "down", "down_with_first_download")
        out = {k: round(statistics.median(r[k] for r in per_seed), 2) for k in keys}
        out["per_seed"] = {str(s): runs[mode][s] for s in seeds if s in runs[mode]}
        return out

    def paired(row: str) -> list[int]:
        return sorted(set(runs[row]) & set(runs["full"]))

    full, delta = summary("full"), summary(default)
    others = {row[len("delta_"):].replace("-", "+"): summary(row, paired(row)) for row in runs
              if row.startswith("delta_") and row != default and paired(row)}
    for codec_name, v in others.items():  # against the float32 runs of the same seeds
        reference = summary("full", [int(k) for k in v["per_seed"]])
        v["points_lost"] = {k: round(reference[k] - v[k], 2) for k in ("final_accuracy", "last_accuracy",
                                                                       "global_final_accuracy",
                                                                       "global_last_accuracy")}
    lost = {k: round(full[k] - delta[k], 2) for k in ("final_accuracy", "last_accuracy",
                                                      "global_final_accuracy", "global_last_accuracy")}
    total = delta["up"] + delta["down"]
    result = {
        "bytes_per_client_round": {"up": delta["up"], "down": delta["down"]},
        "float32": full, "delta": delta,
        "points_lost": lost,
        "other_delta_codecs": others,
        "targets": {"bytes_per_client_round_max": TARGET_BYTES, "bytes_met": total <= TARGET_BYTES,
                    "points_lost_max": TARGET_POINTS,
                    "accuracy_met": max(lost["final_accuracy"], lost["last_accuracy"]) <= TARGET_POINTS},
        "setting": {"agents": AGENTS, "clients_per_round": PER_ROUND, "rounds": rounds, "seeds": seeds,
                    "dataset": "mnist5k", "model": "mnist_cnn", "partition": PARTITION_FILE.name, "fleet": FLEET,
                    "churn": CHURN, "deadline_s": ROUND_TIMEOUT, "local_epochs": LOCAL_EPOCHS,
                    "algorithm": settings.algorithm,
                    "uplink_codec": settings.codec, "downlink_codec": settings.downlink_codec,
                    "downlink_chain": settings.downlink_chain, "downlink_default": settings.downlink,
                    "statistic": "median over seeds",
                    "bytes_per_client_round": f"the delta downlink with {settings.downlink_codec}"},
    }
    controlled = RESULTS / "downlink_controlled.json"
    if STEM == "downlink" and controlled.exists():  # the fairer accuracy comparison, beside the field's
        c = json.loads(controlled.read_text())
        result["controlled"] = {key: c[key] for key in ("bytes_per_client_round", "points_lost", "targets", "setting")}
        result["controlled"]["other_delta_codecs"] = {
            name: {"up": v["up"], "down": v["down"], "points_lost": v["points_lost"]}
            for name, v in c["other_delta_codecs"].items()}
    result["measured_with"] = provenance.measured_with(
        provenance.invoked(), {k: v for k, v in provenance.deciding(settings).items() if k != "downlink"},
        local_epochs=LOCAL_EPOCHS, varies={"downlink": list(MODES)}, data="mnist5k",
        partition=f"bench/data/{PARTITION_FILE.name}", seeds=seeds,
        note=f"the field's simulate runs; cached in bench/results/{RUNS.name}/")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{STEM}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{STEM}.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    s, full, delta = result["setting"], result["float32"], result["delta"]
    kb = 1024
    lines = [
        "# Downlink benchmark",
        "",
        f"`python -m bench.downlink` (bench/downlink.py). Real `broker-coordinator simulate` runs of "
        f"`{s['algorithm']}`: {s['agents']} agents on `bench/data/{s['partition']}` (MNIST-5k, Dirichlet 0.1), "
        f"{s['clients_per_round']} per round, {s['rounds']} rounds, fleet `{s['fleet']}`, churn `{s['churn']}`, "
        f"deadline {s['deadline_s']:.0f} s, "
        f"{'device-chosen epochs' if not s['local_epochs'] else str(s['local_epochs']) + ' local epochs'}, "
        f"uplink `{s['uplink_codec']}`; seeds "
        f"{','.join(map(str, s['seeds']))} (medians over seeds). Down: the model messages devices received "
        "(manifests, chunks, deltas), as each device counted them; up: the accepted signed updates; both per "
        "accepted client-round. Devices follow every version, selected or not. Accuracy in % on the "
        "coordinator's 1,000 held-out images of the served model: B, the broadcast model every device holds "
        "(the global model itself with a float32 downlink); G is the server rule's model, which runs ahead of B "
        f"by what the downlink still owes; \"last {LAST}\" is the mean of the last {LAST} rounds. "
        + ("With device-chosen epochs the host's load (per seed below) moves accuracy more than the downlink "
           "does; the controlled line below fixes the work per client-round." if not s["local_epochs"] else ""),
        "",
        "| downlink | up KB | down KB | up + down KB | down KB with first download | final | last-3 "
        "| final G | last-3 G | best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [("float32 (full)", full),
            (f"delta `{s['downlink_codec']}` (the default codec), chain {s['downlink_chain']}", delta)]
    rows += [(f"delta `{name}`, chain {s['downlink_chain']}", v) for name, v in result["other_delta_codecs"].items()]
    for name, v in rows:
        lines.append(f"| {name} | {v['up'] / kb:.1f} | {v['down'] / kb:.1f} | {(v['up'] + v['down']) / kb:.1f} "
                     f"| {v['down_with_first_download'] / kb:.1f} | {v['final_accuracy']:.2f} | {v['last_accuracy']:.2f} | {v['global_final_accuracy']:.2f} "
                     f"| {v['global_last_accuracy']:.2f} | {v['best_accuracy']:.2f} |")
    lost, t = result["points_lost"], result["targets"]
    total = (delta["up"] + delta["down"]) / kb
    lines += [
        "",
        f"- up + down per client-round with deltas: {total:.1f} KB (target <= {t['bytes_per_client_round_max'] / kb:.0f} "
        f"KB): {'met' if t['bytes_met'] else '**missed**'}; with the float32 downlink "
        f"{(full['up'] + full['down']) / kb:.0f} KB ({full['down'] / max(delta['down'], 1):.0f}x the delta downlink); "
        f"with each device's first download (joining, once) counted in: {(delta['up'] + delta['down_with_first_download']) / kb:.1f} KB.",
        f"- points lost against the float32 downlink (positive: lost): final {lost['final_accuracy']:+.2f}, "
        f"last-3 {lost['last_accuracy']:+.2f} (target <= {t['points_lost_max']}): "
        f"{'met' if t['accuracy_met'] else '**missed**'}; on G: final "
        f"{lost['global_final_accuracy']:+.2f}, last-3 {lost['global_last_accuracy']:+.2f}.",
    ]
    for name, v in result["other_delta_codecs"].items():
        lines.append(f"- delta `{name}`: up + down {(v['up'] + v['down']) / kb:.1f} KB per client-round; points lost "
                     f"against float32: final {v['points_lost']['final_accuracy']:+.2f}, last-3 "
                     f"{v['points_lost']['last_accuracy']:+.2f}; on G: final "
                     f"{v['points_lost']['global_final_accuracy']:+.2f}, last-3 "
                     f"{v['points_lost']['global_last_accuracy']:+.2f} (seeds {','.join(v['per_seed'])}).")
    if "controlled" in result:
        c = result["controlled"]
        lines.append(f"- with the work per client-round fixed (`--controlled`: {c['setting']['local_epochs']} local "
                     f"epochs, seeds {','.join(map(str, c['setting']['seeds']))}; downlink_controlled.md), which "
                     f"takes the host's load out of the comparison: `{c['setting']['downlink_codec']}` lost "
                     f"{c['points_lost']['final_accuracy']:+.2f} (final) and {c['points_lost']['last_accuracy']:+.2f} "
                     f"(last-3) at {(c['bytes_per_client_round']['up'] + c['bytes_per_client_round']['down']) / kb:.1f} "
                     "KB; " + "; ".join(f"`{n}` {v['points_lost']['final_accuracy']:+.2f} / "
                                        f"{v['points_lost']['last_accuracy']:+.2f} at {(v['up'] + v['down']) / kb:.1f} KB"
                                        for n, v in c["other_delta_codecs"].items()) + ".")
    lines += [
        "",
        "Per seed (final accuracy, up / down KB per client-round, wall seconds, load average before/after):",
        "",
    ]
    for mode, v in [("full", full), (f"delta {s['downlink_codec']}", delta)] + [
            (f"delta {n}", v) for n, v in result["other_delta_codecs"].items()]:
        for seed, r in v["per_seed"].items():
            lines.append(f"- {mode} seed {seed}: {r['final_accuracy']:.2f}% (G {r['global_final_accuracy']:.2f}%), "
                         f"{r['up'] / kb:.1f} / {r['down'] / kb:.1f} KB ({r['down_with_first_download'] / kb:.1f} "
                         f"with first downloads), {r['client_rounds']} client-rounds, models trained from: "
                         f"{r['model_via']}, "
                         f"{r['wall_seconds']} s, load {r['load1']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1", help="comma-separated seeds (default 1)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per run (default {ROUNDS})")
    parser.add_argument("--only", choices=MODES + ("codecs",), default=None,
                        help="run one mode only (codecs: only the --codecs runs)")
    parser.add_argument("--codecs", default="", help="comma-separated: also delta runs with these downlink codecs")
    parser.add_argument("--report", action="store_true", help="only rebuild the report from cached runs")
    parser.add_argument("--controlled", action="store_true",
                        help=f"{CONTROLLED['local_epochs']} local epochs, a {CONTROLLED['deadline_s']:.0f} s deadline")
    args = parser.parse_args(argv)
    if args.controlled:
        global RUNS, STEM, LOCAL_EPOCHS, ROUND_TIMEOUT
        RUNS, STEM = RESULTS / "downlink_controlled_runs", "downlink_controlled"
        LOCAL_EPOCHS, ROUND_TIMEOUT = CONTROLLED["local_epochs"], CONTROLLED["deadline_s"]
    if not args.report:
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            for mode in [args.only] if args.only in MODES else [] if args.only else MODES:
                run_one(mode, seed, args.rounds)
            for codec_name in [c for c in args.codecs.split(",") if c]:
                run_one("delta", seed, args.rounds, codec_name)
    try:
        report(args.rounds)
    except SystemExit as exc:
        print(exc)
        return 1
    print((RESULTS / f"{STEM}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
