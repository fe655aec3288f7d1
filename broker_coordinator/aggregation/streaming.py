"""Streaming weighted mean of client deltas: memory O(model), not O(clients x model).

Each accepted update is folded in as it arrives and then dropped. Sums are
float64 so the order of arrival does not change the result beyond float32
rounding.

With `normalize_steps` (FedNova, Wang et al., NeurIPS 2020) each delta is
divided by its local step count a_k before averaging, and the mean is scaled
back by tau_eff = sum_k p_k a_k, so that devices doing more local work do not
pull the average toward their own optimum:
    theta_{t+1} = theta_t + tau_eff * sum_k p_k (delta_k / a_k)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edgefl_protocol.sparse_delta import SparseDelta


class StreamingMean:
    def __init__(self, specs: Mapping[str, tuple[int, ...]], normalize_steps: bool = False) -> None:
        # views of one float64 vector in the specs' order: a SparseDelta in that order adds by position
        self.names = tuple(specs)
        self.flat = np.zeros(sum(int(np.prod(shape)) for shape in specs.values()), dtype=np.float64)
        self.sums, start = {}, 0
        for name, shape in specs.items():
            size = int(np.prod(shape))
            self.sums[name] = self.flat[start:start + size].reshape(shape)
            start += size
        self.normalize_steps = normalize_steps
        self.total_weight = 0.0
        self.weighted_steps = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float, steps: int = 1) -> None:
        if not weight > 0:
            raise ValueError(f"aggregation weight must be positive, got {weight}")
        if self.normalize_steps and steps < 1:
            raise ValueError(f"local steps must be >= 1 for step normalization, got {steps}")
        scale = weight / steps if self.normalize_steps else weight
        if isinstance(tensors, SparseDelta) and tensors.names == self.names:
            self.flat[tensors.positions] += scale * tensors.values  # positions are distinct
        else:
            for name, acc in self.sums.items():
                acc += scale * tensors[name]
        self.total_weight += weight
        self.weighted_steps += weight * steps
        self.count += 1

    def merge(self, sums: Mapping[str, np.ndarray], total_weight: float, weighted_steps: float, count: int) -> None:
        """Fold in another StreamingMean's sums (a site's partial): the sum is associative, so a tree
        of folds gives the flat fold's result up to float rounding."""
        for name, acc in self.sums.items():
            acc += np.asarray(sums[name], dtype=np.float64)
        self.total_weight += total_weight
        self.weighted_steps += weighted_steps
        self.count += count

    def mean(self) -> dict[str, np.ndarray]:
        if self.count == 0:
            raise ValueError("no updates were folded in")
        factor = (self.weighted_steps / self.total_weight) if self.normalize_steps else 1.0
        return {name: (acc * (factor / self.total_weight)).astype(np.float32) for name, acc in self.sums.items()}
