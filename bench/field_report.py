"""The field benchmark's report (bench/field.py): field.md's tables, the targets of the runtime
default, and field.png, from the results `field.report` assembles."""

from __future__ import annotations

import statistics
from pathlib import Path


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def client_optimizer(row: str) -> str:
    """The client optimizer of a row ALGORITHM+CLIENT[+SERVER[@LR]]: sgd or momentum."""
    return row.split("+")[1] if "+" in row else ""


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
    row = default_row(d)
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
              f"{result['default']['optimizer']}, server optimizer {result['default'].get('server_optimizer', 'sgd')}, "
              f"`{result['default']['codec']}`, local_epochs "
              f"{result['default']['local_epochs']}.", ""]
    return "\n".join(lines)


def default_row(default: dict) -> str:
    """The row name of the runtime default: ALGORITHM+CLIENT, +SERVER when its server optimizer is not sgd."""
    row = f"{default['algorithm']}+{default['optimizer']}"
    server = default.get("server_optimizer", "sgd")
    return row if server == "sgd" else f"{row}+{server}"


def plot(details: dict, path: Path, rounds: int, meta: dict) -> None:
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
            name, optimizer, served = row.partition("+")[0], client_optimizer(row), row.count("+") > 1
            xs = list(range(first, n + 1))
            ax.plot(xs, [statistics.median(c[i - 1] for c in curves) for i in xs], color=colors[name],
                    linestyle=("-." if optimizer == "sgd" else ":") if served else ("-" if optimizer == "sgd" else "--"),
                    label=f"{row} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%), median over seeds")
    axes[1].set_title(f"rounds {max(1, rounds // 2)}-{rounds}")
    axes[1].set_ylim(85, 98)
    axes[0].set_title(f"field: {meta['fleet']}, churn {meta['churn']}, deadline {meta['deadline_s']:.0f} s")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
