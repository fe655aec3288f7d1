"""The model the federation serves: the last global model, or an exponential
moving average of the global models (`RoundSettings.serve_average` = its decay).

Sampling half the clients each round makes the global model swing from round
to round under non-IID data, by up to a point of accuracy with local momentum.
Averaging the last few global models smooths that swing; clients still train
from the last global model, so the average never feeds back into training.
Measured on every benchmark run (bench/results/algorithms.md, 'served avg').
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class ServedAverage:
    def __init__(self, initial: Mapping[str, np.ndarray], decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"serve_average must be in [0, 1) (0 = serve the last global model), got {decay}")
        self.decay = decay
        self.weights = {name: np.asarray(a, dtype=np.float32).copy() for name, a in initial.items()}

    def update(self, global_weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Fold in this round's global model; returns the model to serve (and evaluate)."""
        if self.decay == 0:  # the last model itself; the caller replaces, never mutates, its weights
            self.weights = dict(global_weights)
        else:
            for name, a in global_weights.items():
                self.weights[name] = (self.decay * self.weights[name] + (1 - self.decay) * a).astype(np.float32)
        return self.weights
