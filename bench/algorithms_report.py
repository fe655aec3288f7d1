"""The algorithm benchmark's report: bench/results/algorithms.json (the schema of
issue 3), algorithms_details.json, algorithms.md and one accuracy plot per
setting, all rebuilt from the cached runs (`python -m bench.algorithms --report`)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from . import provenance

SERVED_DECAY = "0.75"  # the served-average column: EMA decay chosen on the validation runs (research/tuning.py)
HEADLINE_MARGIN = 0.005  # the target: the default at least 0.5 points above the best baseline
MIN_SEEDS = 2  # a baseline row enters the target check with at least this many seeds (one seed is no mean)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


@dataclass
class Row:
    key: str
    variant: object  # bench.algorithms.Variant
    momentum: float
    seeds: list[int] = field(default_factory=list)
    final: list[float] = field(default_factory=list)
    served: list[float] = field(default_factory=list)  # final accuracy of the EMA-served model, where recorded
    curves: list[list[float]] = field(default_factory=list)
    local_median: list[float] = field(default_factory=list)
    passes: list[float] = field(default_factory=list)  # forward-backward passes per client-round

    @property
    def optimizer(self) -> str:
        return f"sgd+momentum{self.momentum}" if self.momentum else "sgd"

    def final_by_seed(self) -> dict[int, float]:
        return dict(zip(self.seeds, self.final))


def summarize(records: list[dict], variants: dict) -> dict[str, dict[str, Row]]:
    table: dict[str, dict[str, Row]] = {}
    for r in sorted(records, key=lambda r: r["seed"]):
        key = r["variant"] + ("+momentum" if r["momentum"] else "")
        row = table.setdefault(r["setting"], {}).setdefault(key, Row(key, variants[r["variant"]], r["momentum"]))
        row.seeds.append(r["seed"])
        row.final.append(r["accuracy"][-1])
        if SERVED_DECAY in r.get("ema_accuracy", {}):
            row.served.append(r["ema_accuracy"][SERVED_DECAY][-1])
        row.curves.append(r["accuracy"])
        row.local_median.append(statistics.median(r["local_seconds"]))
        row.passes.append(mean([m["passes"] for rnd in r["signals"] for m in rnd.values()]))
    return table


def rounds_to(curve: list[float], target: float) -> int | None:
    return next((i + 1 for i, a in enumerate(curve) if a >= target), None)


def pct(xs: list[float]) -> str:
    return f"{100 * mean(xs):.2f} +- {100 * std(xs):.2f}" if xs else "-"


def target_lines(setting: str, rows: dict[str, Row], default: str, headline: bool) -> list[str]:
    """Where the default (its SGD row: the runtime's default optimizer) stands against the best baseline."""
    ours = rows.get(default)
    baselines = {k: r for k, r in rows.items() if r.variant.algorithm != default and len(r.final) >= MIN_SEEDS}
    if not ours or not baselines:
        return []
    best_key, best = max(baselines.items(), key=lambda kv: mean(kv[1].final))
    margin = mean(ours.final) - mean(best.final)
    ours_momentum = rows.get(default + "+momentum")
    if headline:
        verdict = "met" if margin >= HEADLINE_MARGIN else "missed"
        goal = "target: at least +0.50"
    else:
        verdict = "met" if margin >= -std(best.final) else "missed"
        goal = f"target: not below by more than the best baseline's std ({100 * std(best.final):.2f})"
    lines = [f"Target check: `{default}` (SGD, CPU-sized) {pct(ours.final)} vs best baseline with at least "
             f"{MIN_SEEDS} seeds, `{best_key}`, "
             f"{pct(best.final)}: {100 * margin:+.2f} points ({goal}): **{verdict}**."]
    if ours_momentum:
        lines[0] += (f" With momentum `{default}` scores {pct(ours_momentum.final)} "
                     f"({100 * (mean(ours_momentum.final) - mean(best.final)):+.2f}).")
    return lines + [""]


def ablation_lines(rows: dict[str, Row], default: str, ablation_names: set[str]) -> list[str]:
    lines = ["### Ablation of the default", "",
             "Each component removed (or changed) in turn; the difference is against the default on the same seeds.", "",
             "| variant | optimizer | final accuracy (%) | seeds | vs default, same seeds | passes vs default | what changed |",
             "|---|---|---|---|---|---|---|"]
    for key, row in sorted(rows.items()):
        if row.variant.name not in ablation_names:
            continue
        ref = rows.get(default + ("+momentum" if row.momentum else ""))
        if ref is None:
            continue
        ref_by_seed = ref.final_by_seed()
        paired = [(a, ref_by_seed[s]) for s, a in zip(row.seeds, row.final) if s in ref_by_seed]
        diff = mean([a - b for a, b in paired]) if paired else float("nan")
        lines.append(f"| {key} | {row.optimizer} | {pct(row.final)} | {len(row.final)} | {100 * diff:+.2f} "
                     f"({len(paired)} paired) | {mean(row.passes) / mean(ref.passes):.2f}x | {row.variant.note} |")
    return lines + [""]

def measured_with(records: list[dict], schema: dict) -> dict:
    """Read from the runs themselves: each cached run records its deciding settings
    (`bench.provenance.deciding` of the RoundSettings it ran), fleet, timeout and rounds.
    What is the same in every run goes at the top level; what differs goes under `varies`."""
    if not records:
        return provenance.measured_with(provenance.invoked(), {}, note="no runs")
    missing = [r["variant"] for r in records if "deciding" not in r]
    if missing:
        raise ValueError(f"runs of {', '.join(sorted(set(missing)))} do not record their deciding settings: "
                         "they come from an older pipeline; move them out of the runs folder")
    shared, varies = {}, {}
    for key in records[0]["deciding"]:
        values = sorted({json.dumps(r["deciding"][key]) for r in records})
        if len(values) == 1:
            shared[key] = records[0]["deciding"][key]
        else:
            varies[key] = [json.loads(v) for v in values]
    if "algorithm" in varies:
        varies["algorithm"] = "per row: " + ", ".join(varies["algorithm"])

    def same(key: str):
        values = sorted({json.dumps(r.get(key)) for r in records})
        return json.loads(values[0]) if len(values) == 1 else [json.loads(v) for v in values]

    commands = sorted({r["command"] for r in records if r.get("command")})
    speeds = [r["host_samples_per_s"] for r in records if "host_samples_per_s" in r]
    return provenance.measured_with(
        "; ".join(commands) if commands else provenance.invoked(), shared, varies=varies,
        fleet=same("fleet"), fleet_note="device classes of broker_coordinator/simulation/fleet.py PROFILES, shuffled per "
        "seed (fleet.assign); a device's speed is the host's calibrated one-thread throughput times its class's",
        round_timeout=same("round_timeout"), rounds=same("rounds"), clients_per_round=same("clients_per_round"),
        seeds=sorted({r["seed"] for r in records}),
        seeds_per_row={s: {row: len(v["final_accuracy"]) for row, v in rows.items()}
                       for s, rows in schema["settings"].items()},
        data="the settings of bench/settings.py",
        partition="per setting (bench/settings.py; headline: bench/data/mnist5k_dir01_20clients.npz)",
        host_samples_per_s=[round(min(speeds)), round(max(speeds))] if speeds else "unknown",
        run_commits=sorted({r.get("commit", "unknown") for r in records}),
        note="in process through the shipped engine (bench/inmemory.py): the agent's local training, the codec "
             "with error feedback, the coordinator's fold_round (signature, intake, trust bounds, fold, server "
             "rule, evaluation); local_epochs 0: each device plans its epochs from its emulated speed and "
             "round_timeout (no deadline clock)")


def pipeline_line(measured: dict) -> str:
    """One sentence naming what the numbers were measured with (from `measured_with`, never copied)."""
    epochs = measured.get("local_epochs")
    plan = (f"each device plans its local epochs from its emulated speed and the {measured.get('round_timeout')} s "
            f"round timeout (fleet {measured.get('fleet')})" if epochs == 0 else f"{epochs} local epochs")
    return (f"In process through the shipped engine (bench/fedsim.py, bench/inmemory.py): codec "
            f"`{measured.get('codec')}` with error feedback, aggregator `{measured.get('aggregator')}`, weighting "
            f"`{measured.get('weighting')}`, norm bound {measured.get('norm_bound')}, downlink "
            f"`{measured.get('downlink')}`; {plan}; every setting not varied per row is the shipped default "
            "(`measured_with` in the JSON).")


def report(records: list[dict], variants: dict, default: str, results: Path, out_prefix: str = "algorithms",
           ablation: list | None = None, headline: str = "", runtime_default: str = "") -> None:
    ablation_names = {v.name for v in ablation or []}
    results.mkdir(parents=True, exist_ok=True)
    table = summarize(records, variants)
    # default_algorithm is the runtime's (edgefl_protocol.algorithms.DEFAULT_ALGORITHM); our own algorithm,
    # which would become it only by winning, is named beside it
    schema = {"default_algorithm": runtime_default or default, "our_algorithm": default, "settings": {}}
    details: dict = {"served_average_decay": float(SERVED_DECAY), "settings": {}}
    lines = [f"# Algorithm benchmark ({out_prefix})", "", "PIPELINE", "",
             "Final test accuracy of the last global model (what devices train from), mean +- std over seeds (the "
             f"`seeds` column says how many). 'served avg' is the final accuracy of an exponential moving average "
             f"(decay {SERVED_DECAY}) of the global models, measured beside every run and never fed back: what a "
             "coordinator serves and evaluates with `serve_average` at that decay (the default; "
             "over the seeds that recorded it). Rounds to 90% of the best final accuracy in "
             "the setting are read on the seed-mean curve. Local seconds per client-round are medians recorded "
             "during the runs, with other runs sharing the 2 cores, so they are noisy: research/local_cost.py measures "
             "time under equal conditions, and 'passes' (forward-backward passes per client-round) is the "
             "deterministic cost. Time and passes are relative to fedavg with the same optimizer.", ""]
    for setting, rows in table.items():
        main_rows = {k: r for k, r in rows.items() if r.variant.name not in ablation_names}
        best = max(mean(r.final) for r in main_rows.values())
        schema["settings"][setting] = {}
        details["settings"][setting] = {}
        lines += [f"## {setting}", "", "| algorithm | optimizer | final accuracy (%) | seeds | served avg (%) "
                  "| rounds to 90% of best | local s / client-round | time vs fedavg | passes vs fedavg | note |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for key, row in sorted(rows.items(), key=lambda kv: -mean(kv[1].final)):
            curve = [mean(c) for c in zip(*row.curves)]
            to90 = rounds_to(curve, 0.9 * best)
            ref = rows.get("fedavg" + ("+momentum" if row.momentum else ""))
            ratio = mean(row.local_median) / mean(ref.local_median) if ref else float("nan")
            pass_ratio = mean(row.passes) / mean(ref.passes) if ref else float("nan")
            details["settings"][setting][key] = {
                "variant": row.variant.name, "algorithm": row.variant.algorithm, "hparams": dict(row.variant.hparams),
                "optimizer": row.optimizer, "seeds": row.seeds, "final_accuracy": row.final,
                "final_mean": mean(row.final), "final_std": std(row.final), "served_average_final": row.served,
                "rounds_to_90pct_of_best": to90, "local_seconds_median": statistics.median(row.local_median),
                "local_time_vs_fedavg": ratio, "passes_vs_fedavg": pass_ratio, "mean_curve": curve,
                "note": row.variant.note, "ablation": row.variant.name in ablation_names}
            if row.variant.name in ablation_names:
                continue  # ablation rows: their own table below, and the details file
            schema["settings"][setting][key] = {"final_accuracy": row.final, "local_seconds": row.local_median,
                                                "optimizer": row.optimizer}
            lines.append(f"| {key} | {row.optimizer} | {pct(row.final)} | {len(row.final)} | "
                         f"{pct(row.served) if row.served else '-'}{f' ({len(row.served)})' if row.served and len(row.served) != len(row.final) else ''} | "
                         f"{to90 if to90 else '-'} | {statistics.median(row.local_median):.3f} | "
                         f"{ratio:.2f}x | {pass_ratio:.2f}x | {row.variant.note} |")
        lines.append("")
        lines += target_lines(setting, main_rows, default, setting == headline)
        if any(r.variant.name in ablation_names for r in rows.values()):
            lines += ablation_lines(rows, default, ablation_names)
        plot(setting, main_rows, results / f"{out_prefix}_{setting}.png", default)
        lines += [f"![accuracy per round]({out_prefix}_{setting}.png)", ""]
    schema["measured_with"] = details["measured_with"] = measured_with(records, schema)
    lines[lines.index("PIPELINE")] = pipeline_line(schema["measured_with"])
    (results / f"{out_prefix}.json").write_text(json.dumps(schema, indent=1) + "\n")
    (results / f"{out_prefix}_details.json").write_text(json.dumps(details, indent=1) + "\n")
    (results / f"{out_prefix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(setting: str, rows: dict[str, Row], path: Path, default: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    momenta = sorted({bool(r.momentum) for r in rows.values()})
    fig, axes = plt.subplots(1, len(momenta), figsize=(6 * len(momenta), 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, momentum in zip(axes, momenta):
        for key, row in sorted(rows.items()):
            if bool(row.momentum) != momentum:
                continue
            curve = [100 * mean(c) for c in zip(*row.curves)]
            ax.plot(range(1, len(curve) + 1), curve, label=f"{key} ({100 * mean(row.final):.1f})",
                    linewidth=2.2 if key.startswith(default) else 1.2)
        ax.set_title(f"{setting}, {'SGD + momentum 0.9' if momentum else 'plain SGD'}")
        ax.set_xlabel("round")
        ax.set_ylim(60, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("test accuracy (%), mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
