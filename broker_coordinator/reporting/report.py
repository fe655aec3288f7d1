"""What a run leaves behind: history.json and a plot of the task's metric per round.

Records name their metric (`metric`: accuracy, mse or mae); `score` is the
central evaluation, `federated` the devices' sample-weighted one. Older
records have only `accuracy`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from edgefl_models.objectives import format_score


def write_history(path: Path, rounds: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=2) + "\n")


def _federated(record: dict[str, Any]) -> dict[str, Any]:
    value = record.get("federated") or {}
    return json.loads(value) if isinstance(value, str) else value  # the store keeps it as JSON text


def scores(record: dict[str, Any]) -> tuple[str, float, float]:
    """(metric, central score, federated score) of a round record; NaN where not measured."""
    metric = record.get("metric") or "accuracy"
    central = record.get("score")
    if central is None:
        central = record.get("accuracy", float("nan"))
    federated = _federated(record).get("score", float("nan"))
    return metric, float("nan") if central is None else float(central), float(federated)


def describe_scores(record: dict[str, Any]) -> str:
    """e.g. "accuracy 93.10%" or "mse 0.412 (devices, 240 samples)"."""
    metric, central, federated = scores(record)
    parts = []
    if not math.isnan(central):
        parts.append(f"{metric} {format_score(metric, central)}")
    if not math.isnan(federated):
        count = _federated(record).get("count", 0)
        parts.append(f"{metric} {format_score(metric, federated)} on devices ({count} held-out samples)")
    return ", ".join(parts) or f"{metric} not measured"


def plot_accuracy(path: Path, rounds: list[dict[str, Any]], title: str) -> bool:
    """Write a PNG of the metric per round (central and/or on devices); returns False (and writes
    nothing) when matplotlib is not installed."""
    fig = metric_figure(rounds, title)
    if fig is None:
        return False
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return True


def metric_figure(rounds: list[dict[str, Any]], title: str):  # noqa: ANN201 (a matplotlib Figure, or None)
    """The figure `plot_accuracy` writes: the metric against rounds, whole rounds on the x axis."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    metric = scores(rounds[0])[0] if rounds else "accuracy"
    scale = 100 if metric == "accuracy" else 1
    fig, ax = plt.subplots(figsize=(6, 4))
    for index, label in ((1, "central test set"), (2, "devices' held-out data")):
        points = [(r["round"], scale * scores(r)[index]) for r in rounds if not math.isnan(scores(r)[index])]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=label)
    spent = [(r["round"], r["privacy"]["epsilon"]) for r in rounds if (r.get("privacy") or {}).get("epsilon")]
    if spent:  # [privacy]: the epsilon spent at delta, on its own axis
        eps_ax = ax.twinx()
        eps_ax.plot(*zip(*spent), color="tab:red", linestyle="--", label="epsilon spent")
        eps_ax.set_ylabel(f"epsilon spent (delta {rounds[-1]['privacy'].get('delta', 0):g})", color="tab:red")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole: no tick at 2.5
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (%)" if metric == "accuracy" else metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def format_round(record: dict[str, Any], rounds: int) -> str:
    """One line per round; `rounds` 0 (a federation that runs until stopped) prints no total."""
    width = len(str(rounds or record["round"]))
    rejected = sum(record["rejected"].values())
    extra = f"  rejected {rejected}" if rejected else ""
    bounded = record.get("clipped") or {}
    if bounded:  # accepted, but the server bounded them (weight, norm) or left them out (direction)
        extra += "  bounded " + ", ".join(f"{how} {n}" for how, n in sorted(bounded.items()))
    if record["closed"] == "abandoned":
        extra += "  ABANDONED (no quorum)"
    metric, central, federated = scores(record)
    if record.get("kind") == "evaluate":
        measured = f"evaluated on devices: {metric} {format_score(metric, federated)}"
    else:
        measured = f"{metric} {format_score(metric, central):>7}"
        if not math.isnan(federated):
            measured += f" (devices {format_score(metric, federated)})"
        measured += f"  loss {record['loss']:.4f}"
    if (record.get("privacy") or {}).get("epsilon") is not None:
        extra += f"  epsilon {record['privacy']['epsilon']:.3f}"
    total = f"/{rounds}" if rounds else ""
    return (f"round {record['round']:>{width}}{total}  "
            f"participants {record['participants']:>3}/{record['selected']:<3} "
            f"{measured}  up {record['bytes_up'] / 1e6:7.2f} MB  {record['seconds']:6.1f} s{extra}")
