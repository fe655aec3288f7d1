"""Streaming weighted mean of client deltas: memory O(model), not O(clients x model).

Each accepted update is folded in as it arrives and then dropped. The sum is
kept in float64 so that the order of arrival does not change the result
beyond float32 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class StreamingMean:
    def __init__(self, specs: Mapping[str, tuple[int, ...]]) -> None:
        self.sums = {name: np.zeros(shape, dtype=np.float64) for name, shape in specs.items()}
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"aggregation weight must be positive, got {weight}")
        for name, acc in self.sums.items():
            acc += weight * tensors[name]
        self.total_weight += weight
        self.count += 1

    def mean(self) -> dict[str, np.ndarray]:
        if self.count == 0:
            raise ValueError("no updates were folded in")
        return {name: (acc / self.total_weight).astype(np.float32) for name, acc in self.sums.items()}
