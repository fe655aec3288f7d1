"""Buffered damping: a stage that wraps a round's fold when its answers were trained on older
model versions (FedBuff, Nguyen et al., AISTATS 2022).

An answer s versions behind counts with the factor f(s) of `staleness.py`. The buffer's step is

    step = sum_k n_k f(s_k) delta_k / sum_k n_k

FedBuff's sum_k f(s_k) delta_k / K with sample weights n_k. The server rule is told the damping
sum_k n_k f(s_k) / sum_k n_k and the mean staleness (its `pace`), so that an algorithm with a
server dual adds up the undamped mean, as the devices' duals do.

Device updates and site partials are damped at different places, with the same bookkeeping
(`Staleness`):
- updates: the wrapped fold is given each update with the weight n_k f(s_k), so the norm bound
  and the direction gate see every delta at its own length; the step is scaled by the damping on
  the way out (`Damped(fold, scale_step=True)`);
- partials: a partial's sums come scaled by f(s_j) and its weight W_j unscaled, so the centre's
  fold of partials yields the damped step as it is (`scale_step=False`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from broker_coordinator.aggregation.fold import Fold, FoldReport
from edgefl_protocol.site_partials import VOTES, Partial


class Staleness:
    """The damping and mean staleness of what a buffer holds."""

    def __init__(self) -> None:
        self.weight = 0.0  # sum n_k f(s_k): the weights the fold was given
        self.undamped = 0.0  # sum n_k
        self.stale = 0.0  # sum n_k s_k

    def record(self, weight: float, undamped: float, staleness: int) -> None:
        """An answer the fold was given with `weight` = n_k f(s_k); `undamped` = n_k."""
        self.weight += weight
        self.undamped += undamped
        self.stale += undamped * staleness

    @property
    def damping(self) -> float:
        return self.weight / self.undamped if self.undamped else 1.0

    @property
    def delay(self) -> float:
        """The mean staleness, weighted by n_k (the server rule's `pace`)."""
        return self.stale / self.undamped if self.undamped else 0.0

    def paced(self, report: FoldReport) -> FoldReport:
        report.damping, report.delay = self.damping, self.delay
        return report


class Damped:
    """A buffer's fold wrapped in its damping. Updates (`add`, then `damp`) are given to the fold
    with their damped weight and the step is scaled on the way out; partials (`add_partial`)
    arrive with their sums scaled and their weight not, so the fold's step is already damped."""

    def __init__(self, fold: Fold, *, scale_step: bool) -> None:
        self.fold = fold
        self.scale_step = scale_step
        self.staleness = Staleness()
        # the live records the verdicts read are the wrapped fold's own
        self.clipped, self.centered, self.gated = fold.clipped, fold.centered, fold.gated
        self.discounted = fold.discounted

    @property
    def count(self) -> int:
        return self.fold.count

    @property
    def center(self) -> Mapping[str, np.ndarray] | None:
        return self.fold.center

    def undecided(self, device: str) -> bool:
        return self.fold.undecided(device)

    def add(self, device: str, delta: Mapping[str, np.ndarray], weight: float, steps: int = 1,
            norm: float | None = None) -> None:
        """A device update whose `weight` is n_k f(s_k), already damped (`damp` records by how much)."""
        self.fold.add(device, delta, weight, steps, norm)  # type: ignore[attr-defined]

    def damp(self, weight: float, factor: float, staleness: int) -> None:
        """The update just added, of fold weight `weight` = n_k f(s_k), was `staleness` versions old
        and had the factor `factor` = f(s_k)."""
        self.staleness.record(weight, weight / factor, staleness)

    def add_partial(self, partial: Partial, sums: Mapping[str, np.ndarray], factor: float, staleness: int) -> None:
        """A site's partial: its sums times f(s_j), its weight W_j unscaled (a sign vote is a count)."""
        self.fold.add(partial, {name: a if name == VOTES else np.asarray(a, dtype=np.float64) * factor  # type: ignore[attr-defined]
                                for name, a in sums.items()})
        self.staleness.record(partial.total_weight * factor, partial.total_weight, staleness)

    def result(self) -> dict[str, np.ndarray]:
        step = self.fold.result()
        if not self.scale_step:
            return step
        damping = self.staleness.damping
        return {name: (a * damping).astype(np.float32) for name, a in step.items()}

    def report(self) -> FoldReport:
        return self.staleness.paced(self.fold.report())
