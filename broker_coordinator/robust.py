"""One round's fold of client deltas, robust to the devices that lie.

Every delta is first scaled down to the adaptive norm bound (`trust.NormBound`),
then combined by one of (`RoundSettings.aggregator`):

- `gated_mean` (default): the weighted mean of the deltas that point the
  same way as the round's coordinate-wise median (cosine > 0). A length bound
  alone cannot stop a device that sends its own update reversed: under
  non-IID data it erases what its classes taught the model, at full length.
  The median of the round is a direction a minority cannot turn, and honest
  deltas agree with it (measured on the headline partition: cosine 0.1-0.4,
  rarely slightly below 0; a reversed delta -0.4 to -0.6). At least half of
  the round (the most aligned) is always kept. Holds the round's deltas:
  memory O(cohort x model).
- `mean`: the weighted mean, streamed (memory O(model)) once the bound is
  known; on a cold start the first round's updates are held until it closes,
  then clipped against the median of their own norms.
- `trimmed_mean`: per coordinate, drop the `trim` fraction of largest and of
  smallest values, average the rest (Yin et al., ICML 2018). Unweighted.
- `median`: per coordinate median (Yin et al., ICML 2018). Unweighted.

The last two hold the round's deltas (memory O(cohort x model)) and ignore
sample weights and step normalization: that is their price.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from .aggregation import StreamingMean
from .trust import NormBound

AGGREGATORS = ("gated_mean", "mean", "trimmed_mean", "median")


@dataclass
class Held:
    device: str
    delta: dict[str, np.ndarray]
    weight: float
    steps: int
    norm: float


def l2_norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(a.ravel().astype(np.float64), a.ravel())) for a in tensors.values())))


class RobustRound:
    def __init__(self, specs: Mapping[str, tuple[int, ...]], bound: NormBound, aggregator: str = "gated_mean",
                 trim: float = 0.2, normalize_steps: bool = False,
                 reference: Callable[[list[str]], np.ndarray] | None = None) -> None:
        """`reference(names)`, if given, is the gate's direction (flattened in the order of `names`)
        instead of the round's coordinate-wise median (see `reference.py`)."""
        self.reference = reference
        if aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {aggregator!r}")
        self.specs, self.bound, self.aggregator, self.trim = dict(specs), bound, aggregator, trim
        self.stream = StreamingMean(specs, normalize_steps=normalize_steps)
        self.held: list[Held] = []
        self.clipped: dict[str, tuple[float, float]] = {}  # device -> (norm, bound) of every clipped delta
        self.gated: dict[str, float] = {}  # device -> cosine with the round's median, for every dropped delta
        self.count = 0

    def add(self, device: str, delta: Mapping[str, np.ndarray], weight: float, steps: int = 1) -> None:
        if not weight > 0:
            raise ValueError(f"aggregation weight must be positive, got {weight}")
        norm = l2_norm(delta)
        self.count += 1
        bound = self.bound.bound()
        if self.aggregator == "mean" and (bound is not None or not self.bound.enabled):
            self.stream.add(self._clip(device, delta, norm, bound), weight, steps)
        else:
            self.held.append(Held(device, {n: np.asarray(a, dtype=np.float32) for n, a in delta.items()},
                                  weight, steps, norm))

    def _clip(self, device: str, delta: Mapping[str, np.ndarray], norm: float,
              bound: float | None) -> Mapping[str, np.ndarray]:
        if bound is None:
            return delta
        self.bound.record(min(norm, bound))
        if norm <= bound:
            return delta
        self.clipped[device] = (norm, bound)
        scale = bound / norm
        return {name: a * scale for name, a in delta.items()}

    def mean(self) -> dict[str, np.ndarray]:
        """The round's aggregate delta (called once, when the round closes)."""
        if self.count == 0:
            raise ValueError("no updates were folded in")
        clipped = self._clip_held()
        if self.aggregator == "gated_mean":
            clipped = self._gate(clipped)
        if self.aggregator in ("mean", "gated_mean"):
            for h, delta in clipped:
                self.stream.add(delta, h.weight, h.steps)
            return self.stream.mean()
        out = {}
        for name in self.specs:
            stack = np.stack([delta[name] for _, delta in clipped]).astype(np.float64)
            out[name] = (np.median(stack, axis=0) if self.aggregator == "median"
                         else trimmed_mean(stack, self.trim)).astype(np.float32)
        return out


    def _clip_held(self) -> list[tuple[Held, Mapping[str, np.ndarray]]]:
        bound = self.bound.bound([h.norm for h in self.held]) if self.held else None
        clipped = [(h, self._clip(h.device, h.delta, h.norm, bound)) for h in self.held]
        self.held = []
        return clipped

    def streamed(self) -> StreamingMean:
        """Aggregator "mean" only: the weighted sums with any held (cold-start) deltas clipped and
        folded in; what a site aggregator sends up instead of the mean (see `partials`)."""
        if self.aggregator != "mean":
            raise ValueError(f"only aggregator \"mean\" folds into plain sums, not {self.aggregator!r}")
        for h, delta in self._clip_held():
            self.stream.add(delta, h.weight, h.steps)
        return self.stream

    def _gate(self, clipped: list[tuple[Held, Mapping[str, np.ndarray]]]) -> list[tuple[Held, Mapping[str, np.ndarray]]]:
        """Keep the deltas whose cosine with the round's coordinate-wise median is positive (at least
        the most aligned half); record the others in `gated`."""
        if len(clipped) < 3:
            return clipped  # no majority to speak of
        names = list(self.specs)
        flat = np.stack([np.concatenate([np.ravel(d[n]) for n in names]) for _, d in clipped]).astype(np.float32)
        reference = self.reference(names) if self.reference else np.median(flat, axis=0)
        ref_norm = float(np.linalg.norm(reference)) or 1.0
        cosines = flat @ reference / (np.linalg.norm(flat, axis=1).clip(min=1e-12) * ref_norm)
        keep_at_least = -(-len(clipped) // 2)
        ranked = np.argsort(-cosines)
        kept = {int(i) for rank, i in enumerate(ranked) if cosines[i] > 0 or rank < keep_at_least}
        for i, (h, _) in enumerate(clipped):
            if i not in kept:
                self.gated[h.device] = float(cosines[i])
        return [item for i, item in enumerate(clipped) if i in kept]


def trimmed_mean(stack: np.ndarray, trim: float) -> np.ndarray:
    """Mean over axis 0 after dropping the `trim` fraction from each end (at least one value kept)."""
    n = stack.shape[0]
    k = min(int(np.floor(trim * n)), (n - 1) // 2)
    if k == 0:
        return stack.mean(axis=0)
    ordered = np.sort(stack, axis=0)
    return ordered[k:n - k].mean(axis=0)
