"""How good the global model is: on the coordinator's test set, or on the devices' held-out slices.

A device's held-out samples never leave it; it reports its metric and how many
samples it measured, and the coordinator combines the reports weighted by
those counts (so a mean error or an accuracy over all held-out samples).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective


def evaluate(model: nn.Module, data: Dataset, batch_size: int = 1000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) of a classifier: the benchmarks' shorthand."""
    result = Objective().evaluate(model, data, batch_size)
    return result.score, result.loss


def federated_score(metric: str, reports: Mapping[str, tuple[float, float, int]], model_version: int) -> dict[str, Any]:
    """The sample-weighted metric and loss over the devices' reports (device -> score, loss, count);
    {} when no device reported."""
    valid = {d: r for d, r in reports.items() if r[2] > 0 and math.isfinite(r[0]) and math.isfinite(r[1])}
    count = sum(r[2] for r in valid.values())
    if count == 0:
        return {}
    return {"metric": metric, "score": sum(r[0] * r[2] for r in valid.values()) / count,
            "loss": sum(r[1] * r[2] for r in valid.values()) / count, "count": count,
            "devices": len(valid), "model_version": model_version}
