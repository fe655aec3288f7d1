"""What people read: the metric plot's x axis counts whole rounds."""

from __future__ import annotations

import pytest

from broker_coordinator.reporting.report import metric_figure, plot_accuracy


@pytest.mark.parametrize("count", [3, 20, 40])
def test_the_plot_ticks_whole_rounds(tmp_path, count):
    pytest.importorskip("matplotlib")
    rounds = [{"round": r, "metric": "accuracy", "score": r / (count + 1), "federated": {}} for r in range(1, count + 1)]
    fig = metric_figure(rounds, "test")
    ax = fig.axes[0]
    fig.canvas.draw()
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert plot_accuracy(tmp_path / "accuracy.png", rounds, "test") and (tmp_path / "accuracy.png").stat().st_size > 0
