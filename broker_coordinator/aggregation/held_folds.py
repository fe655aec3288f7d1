"""The coordinate- and point-wise statistics of the folds that hold their round (robust.py):
`geomed`'s weighted geometric median and `trimmed_mean`'s per-coordinate trim."""

from __future__ import annotations

import numpy as np

GEOMED_ITERATIONS = 8  # Weiszfeld steps: RFA reports 3-4 enough; the held round is small


def geometric_median(points: np.ndarray, weights: np.ndarray, iterations: int = GEOMED_ITERATIONS,
                     eps: float = 1e-8) -> np.ndarray:
    """The weighted geometric median of the rows of `points` (smoothed Weiszfeld, as RFA: Pillutla,
    Kakade and Harchaoui, IEEE TSP 2022), started from the weighted mean."""
    w = weights / weights.sum()
    z = w @ points
    for _ in range(iterations):
        beta = w / np.maximum(eps, np.linalg.norm(points - z, axis=1))
        moved = beta @ points / beta.sum()
        done = np.linalg.norm(moved - z) <= 1e-6 * max(np.linalg.norm(z), eps)
        z = moved
        if done:
            break
    return z


def trimmed_mean(stack: np.ndarray, trim: float) -> np.ndarray:
    """Mean over axis 0 after dropping the `trim` fraction from each end (at least one value kept)."""
    n = stack.shape[0]
    k = min(int(np.floor(trim * n)), (n - 1) // 2)
    if k == 0:
        return stack.mean(axis=0)
    ordered = np.sort(stack, axis=0)
    return ordered[k:n - k].mean(axis=0)
