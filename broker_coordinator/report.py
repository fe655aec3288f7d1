"""What a run leaves behind: history.json and an accuracy-per-round plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_history(path: Path, rounds: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=2) + "\n")


def plot_accuracy(path: Path, rounds: list[dict[str, Any]], title: str) -> bool:
    """Write a PNG; returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["round"] for r in rounds], [100 * r["accuracy"] for r in rounds], marker="o", markersize=3)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def format_round(record: dict[str, Any], rounds: int) -> str:
    width = len(str(rounds))
    rejected = sum(record["rejected"].values())
    extra = f"  rejected {rejected}" if rejected else ""
    bounded = record.get("clipped") or {}
    if bounded:  # accepted, but the server bounded them (weight, norm) or left them out (direction)
        extra += "  bounded " + ", ".join(f"{how} {n}" for how, n in sorted(bounded.items()))
    if record["closed"] == "abandoned":
        extra += "  ABANDONED (no quorum)"
    return (f"round {record['round']:>{width}}/{rounds}  participants {record['participants']:>3}/{record['selected']:<3} "
            f"accuracy {100 * record['accuracy']:6.2f}%  loss {record['loss']:.4f}  "
            f"up {record['bytes_up'] / 1e6:7.2f} MB  {record['seconds']:6.1f} s{extra}")
