"""A decoded top-k update as its nonzero coordinates, so that a fold can work on them alone.

The default codec (`auto`) keeps a tenth of each tensor's values on models of 10,000 parameters or
more, so nine in ten coordinates of a decoded delta are zero, and the decoder knows which
(sparse_decode.py). The coordinator's per-update work
(the delta's norm, the consensus sketch, its distance from the centre, the float64 sums) is linear
or quadratic in the delta, so on the kept values it gives the dense result: exactly for the sums
(adding a zero is exact), to float rounding for the norms and the sketch (another order of
summation). On the 80k CNN that is 8k values instead of 80k per operation (bench/runtime.py).

A SparseDelta is also the Mapping name -> tensor of the dense result (views of one float32
vector), so every other consumer reads it as it reads a plain decoded delta.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np


class SparseDelta(Mapping[str, np.ndarray]):
    """Tensors `names` (shapes `shapes`) laid end to end in one flat vector of `size` values, of
    which only `positions` (distinct, increasing) may be nonzero, holding `values` (float32)."""

    def __init__(self, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], positions: np.ndarray,
                 values: np.ndarray, flat: np.ndarray | None = None) -> None:
        self.names, self.shapes = names, shapes
        self.size = sum(math.prod(shape) for shape in shapes)
        self.positions, self.values = positions, values
        self._flat = flat  # the dense vector, built when a tensor is asked for
        self._tensors: dict[str, np.ndarray] | None = None

    def scaled(self, factor: float) -> SparseDelta:
        """The delta times `factor`, in float32 as `a * factor` on the dense tensors."""
        return SparseDelta(self.names, self.shapes, self.positions, self.values * np.float32(factor))

    def first(self, count: int) -> SparseDelta:
        """Its first `count` tensors (the model's, before an algorithm's extra tensors)."""
        if count == len(self.names):
            return self
        size = sum(math.prod(shape) for shape in self.shapes[:count])
        cut = int(np.searchsorted(self.positions, size))
        return SparseDelta(self.names[:count], self.shapes[:count], self.positions[:cut], self.values[:cut],
                           None if self._flat is None else self._flat[:size])

    def norm(self) -> float:
        return float(np.sqrt(float(np.dot(self.values, self.values))))

    @property
    def flat(self) -> np.ndarray:
        if self._flat is None:
            self._flat = np.zeros(self.size, dtype=np.float32)
            self._flat[self.positions] = self.values
        return self._flat

    def tensors(self) -> dict[str, np.ndarray]:
        """name -> tensor, views of the dense vector."""
        if self._tensors is None:
            out, start, flat = {}, 0, self.flat
            for name, shape in zip(self.names, self.shapes):
                size = math.prod(shape)
                out[name] = flat[start:start + size].reshape(shape)
                start += size
            self._tensors = out
        return self._tensors

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class Decoded(dict):
    """A decoded update, name -> tensor, that remembers its top-k tensors as one SparseDelta."""

    sparse: SparseDelta | None = None


def sparse_only(delta: Mapping[str, np.ndarray], names: Mapping[str, object]) -> Mapping[str, np.ndarray]:
    """`delta`'s tensors `names`: its SparseDelta when it has one for exactly those, else a plain dict."""
    sparse = getattr(delta, "sparse", None)
    wanted = tuple(names)
    if isinstance(sparse, SparseDelta) and sparse.names[:len(wanted)] == wanted:
        return sparse.first(len(wanted))
    return {name: delta[name] for name in names}
