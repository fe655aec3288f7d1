"""`[privacy] mode = "central"` in sites: the workers forward clipped sums and the centre adds the
noise (docs/PRIVACY.md).

Down: a site task's rules carry `privacy` = {"clip": C, "sampling": "poisson" | "fixed", "rate": q}
(`PrivateRounds.site_rules`). The clip is this round's: the adaptive clip moves at the centre only.
The site's leader draws its cohort with the operating system's CSPRNG (`secrets.SystemRandom`,
never the worker's seeded generator): with `poisson` each eligible device joins with probability
q = m / N, whatever the site's quota; with `fixed` exactly the site's quota of its eligible devices.

At the site: every worker folds with the private fold without noise (`PrivateRound` with z = 0:
each delta clipped to C, weight 1; claimed sample counts and steps ignored) and sends the clipped
sum in an ordinary partial, as weighted sums with total_weight = weighted_steps = count, plus two
optional fields: `clip` (the C it clipped to) and `unclipped` (the exact count of deltas under C).

Up: the centre (`PrivateTreeSum`) checks each partial against the round, merges the clipped sums
into the round's own `PrivateRound`, and takes its noisy mean as a flat round does: Gaussian noise
z_delta C once per applied version over the fixed denominator m, the adaptive clip moved from the
noisy unclipped count, the ledger spent once. The same devices' updates give the same pre-noise sum
flat or through sites, and from the same generator the same released mean.

A site is trusted like the coordinator: it sees its devices' updates. What the centre can check it
does (`check`): the partial was clipped to this round's C, weighs every delta 1, carries no extra
tensors, its unclipped count is within its count, and its sum's norm is at most count * C.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker_coordinator.aggregation.fold import FoldReport
from broker_coordinator.aggregation.privacy import PrivateRound
from broker_coordinator.aggregation.robust import l2_norm
from broker_coordinator.aggregation.tree_sum import PartialNotes
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import Partial

SAMPLINGS = ("poisson", "fixed")


@dataclass(frozen=True)
class SitePrivacy:
    """What a site needs of the round's privacy: the clip and how its leader samples."""
    clip: float
    sampling: str  # poisson | fixed
    rate: float  # q = m / N (poisson); fixed: unused (the site task's quota)

    def rules(self) -> dict[str, Any]:
        return {"privacy": {"clip": self.clip, "sampling": self.sampling, "rate": self.rate}}

    def draw(self, eligible: Sequence[str], quota: int) -> set[str]:
        """The site's cohort, from the operating system's CSPRNG (quota 0: every eligible device)."""
        rng = secrets.SystemRandom()
        eligible = sorted(eligible)
        if self.sampling == "poisson":
            return {d for d in eligible if rng.random() < self.rate}
        return set(rng.sample(eligible, min(quota or len(eligible), len(eligible))))

    def fold(self, specs: Mapping[str, tuple[int, ...]]) -> PrivateRound:
        """The site's fold: clipped to C, weight 1, no noise (the centre adds it once)."""
        return PrivateRound(specs, self.clip, 0.0, 1.0)


def site_privacy(rules: Mapping[str, Any]) -> SitePrivacy | None:
    """The site task's privacy rules, checked (None: the round is not private). Raises Rejected."""
    obj = rules.get("privacy")
    if obj is None:
        return None
    try:
        privacy = SitePrivacy(float(obj["clip"]), str(obj["sampling"]), float(obj["rate"]))
    except (TypeError, KeyError, ValueError):
        raise Rejected("schema", "site task: rules.privacy must be {clip, sampling, rate}") from None
    if not (math.isfinite(privacy.clip) and privacy.clip > 0 and privacy.sampling in SAMPLINGS
            and 0 < privacy.rate <= 1):
        raise Rejected("schema", f"site task: privacy clip {privacy.clip} must be > 0, sampling one of "
                                 f"{', '.join(SAMPLINGS)} and rate {privacy.rate} in (0, 1]")
    return privacy


def partial_fields(fold: PrivateRound) -> dict[str, Any]:
    """A private site fold's optional partial fields."""
    return {"clip": fold.clip, "unclipped": fold.unclipped}


class PrivateTreeSum:
    """The round's aggregate of private partials (a `fold.Fold` of partials): the clipped sums merged
    into the round's `PrivateRound`, whose `result` adds the noise, and the partials' notes (the
    devices' summaries and evaluations). Nothing is bounded per site: how many devices were clipped
    is released only with noise."""

    def __init__(self, fold: PrivateRound) -> None:
        self.fold = fold
        self.notes = PartialNotes()
        self.extras = None  # a private partial carries no extra tensors (`check`)
        self.clipped: dict[str, tuple[float, float]] = {}
        self.centered: dict[str, tuple[float, float]] = {}
        self.gated: dict[str, float] = {}
        self.discounted: dict[str, tuple[float, str]] = {}

    @property
    def count(self) -> int:
        return self.fold.count

    @property
    def center(self) -> None:
        return None

    @property
    def clip(self) -> float:
        return self.fold.clip

    def undecided(self, device: str) -> bool:
        return False

    def report(self) -> FoldReport:
        return FoldReport(self.count, reports=self.notes.reports, bytes_down=self.notes.bytes_down,
                          released=dict(self.fold.released), private=True)

    def check(self, partial: Partial, sums: Mapping[str, np.ndarray]) -> None:
        """What the centre can verify of a site's private fold. Raises Rejected."""
        if partial.count == 0:
            return
        if not math.isclose(partial.clip, self.clip, rel_tol=1e-9):
            raise Rejected("not_private", "partial is not a private fold (no clip: a site aggregator from "
                                          "before privacy in sites; upgrade it)" if partial.clip == 0 else
                           f"partial was clipped to {partial.clip:.6g}, this round's clip is {self.clip:.6g}")
        if partial.total_weight != partial.count or partial.weighted_steps != partial.count or partial.extras_count:
            raise Rejected("not_private", f"a private partial weighs each of its {partial.count} deltas 1 and "
                                          f"carries no extra tensors (total weight {partial.total_weight:g}, "
                                          f"{partial.extras_count} extras)")
        norm, bound = l2_norm({n: sums[n] for n in self.fold.specs}), partial.count * self.clip
        if norm > bound * (1 + 1e-5) + 1e-6:  # float32 on the wire
            raise Rejected("not_private", f"the clipped sum of {partial.count} deltas has norm {norm:.6g}, "
                                          f"above {partial.count} x clip {self.clip:.6g}")

    def add(self, partial: Partial, sums: Mapping[str, np.ndarray]) -> None:
        self.fold.merge({n: sums[n] for n in self.fold.specs}, partial.count, partial.unclipped)
        self.notes.add(partial)

    def result(self, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
        return self.fold.result(rng)

    def clipped_sum(self) -> dict[str, np.ndarray]:
        return self.fold.clipped_sum()
