"""The centre's aggregate of a round's site partials (`TreeSum`): each site bounded as one more
device of the centre. The partials' wire format is edgefl_protocol.site_partials.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Mapping

import numpy as np

from broker_coordinator.aggregation.fold import FoldReport
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import GROWTH, MIN_STANDING
from broker_coordinator.aggregation.votes import SignVotes
from edgefl_protocol.site_partials import VOTES, Partial

log = logging.getLogger("broker_coordinator")


class PartialNotes:
    """What the round's partials say besides their sums: the devices' pooled evaluations and the
    summaries of their metrics (kept alike by the private fold of partials)."""

    def __init__(self) -> None:
        self.summary: dict[str, list] = {}  # metric -> [count, sum, min, max] over the sites' devices
        self.reports = 0  # devices whose evaluation the partials carry

    def add(self, partial: Partial) -> None:
        self.reports += int(partial.evaluation[3]) if partial.evaluation else 0
        for key, row in partial.summary.items():
            mine = self.summary.setdefault(key, [0, 0.0, row[2], row[3]])
            mine[0] += row[0]
            mine[1] += row[1]
            mine[2], mine[3] = min(mine[2], row[2]), max(mine[3], row[3])

    @property
    def bytes_down(self) -> int:
        """Model bytes the sites' devices say they received (a measurement, trusted for nothing)."""
        return int(self.summary.get("bytes_down", [0, 0.0])[1])


class TreeSum:
    """The round's aggregate from partials, where a site is one more device of the centre.

    A `fold.Fold` whose answers are partials (`add(partial, sums)`). A partial is a claim as a device's update is, so the centre bounds it
    by the same rules before it counts (a forged partial, correctly signed by a compromised site,
    then moves the model at most by its share):
    - its device count to what the site may hold (`allowed`: the round's quota for the site, or
      the registry's count of its devices; summed over the site's workers);
    - its weight to that count times `weight_cap` times the median per-device weight of the
      round's partials (`weighting = "reported"` trusts the sites' weights as the devices');
    - its mean step's distance from the round's centre (its length, without one) to `norm_bound`
      times the median distance of the round's partials, when there are 3 or more (0: off);
      clipped partials share at most `OUTLIER_SHARE` of the round's weight when the fold is
      centered_clip, exactly as clipped updates do at a site, and a site clipped round after round
      loses standing as a device does (`standing`, kept by the tree in memory).
    The partials are held until the round closes: memory O(partials x model), partials being
    one per site worker.
    """

    def __init__(self, specs: Mapping[str, tuple[int, ...]], normalize_steps: bool,
                 extra_specs: Mapping[str, tuple[int, ...]] | None = None, *, round_no: int = 0,
                 allowed: Mapping[str, int] | None = None, center: Mapping[str, np.ndarray] | None = None,
                 weighting: str = "uniform", weight_cap: float = 2.0, norm_bound: float = 0.0,
                 outlier_share: float | None = None, standing: dict[str, float] | None = None,
                 sign_quorum: float = 0.0) -> None:
        self.stream = StreamingMean(specs, normalize_steps)
        self.votes = SignVotes(specs, sign_quorum) if sign_quorum > 0 else None
        self.unvoted: float | None = None
        self.specs = dict(specs)
        self.extras = StreamingMean(extra_specs) if extra_specs else None
        self.round_no, self.allowed = round_no, dict(allowed) if allowed is not None else None
        self.center = center
        self.weighting, self.weight_cap, self.norm_bound = weighting, weight_cap, norm_bound
        self.outlier_share = outlier_share
        self.standing = standing if standing is not None else {}  # site -> share of its weight it keeps (the tree's)
        self.discounted: dict[str, tuple[float, str]] = {}  # "site S" -> (the standing its weight kept, why)
        self.partials: list[tuple[str, int, float, float, dict[str, np.ndarray]]] = []  # site, count, W, steps, sums
        self.counted: Counter[str] = Counter()  # site -> devices counted so far this round
        self.clipped: dict[str, tuple[float, float]] = {}
        self.centered: dict[str, tuple[float, float]] = {}  # "site S" -> (distance, radius) of clipped partials
        self.weighed: dict[str, tuple[float, float]] = {}  # "site S" -> (claimed, bounded) weight
        self.gated: dict[str, float] = {}
        self.bounded: Counter[str] = Counter()  # what the sites clipped, by kind, and what the centre did
        self.notes = PartialNotes()
        self._mean: dict[str, np.ndarray] | None = None

    @property
    def count(self) -> int:
        return sum(self.counted.values())

    def add(self, partial: Partial, sums: Mapping[str, np.ndarray]) -> None:
        site, count = partial.site, partial.count
        if self.allowed is not None and self.allowed.get(site, 0) > 0:
            count = max(0, min(count, self.allowed[site] - self.counted[site]))
            if count < partial.count:
                log.warning("round %d: partial from site %s claims %d updates; counted as %d (the site may hold "
                            "%d this round)", self.round_no, site, partial.count, count, self.allowed[site])
                self.bounded["site_count"] += 1
        if count > 0 and partial.total_weight > 0:
            self.counted[site] += count
            self.partials.append((site, count, partial.total_weight, partial.weighted_steps,
                              {n: np.asarray(sums[n], dtype=np.float64) for n in self.stream.sums}))
            if self.votes is not None:
                # a site casts at most one vote per device it may count (a forged partial included); a site
                # that sent none (the stage off there) adds its devices to the quorum without voting
                net = sums.get(VOTES)
                limit = min(count, partial.voters) if net is not None else 0
                self.votes.merge(np.clip(net, -limit, limit) if net is not None else 0, count)
        if self.extras is not None and partial.extras_count:
            extras = min(partial.extras_count, max(count, 1))
            scale = extras / partial.extras_count
            self.extras.merge({n: np.asarray(sums[n], dtype=np.float64) * scale for n in self.extras.sums},
                              float(extras), float(extras), extras)
        self.bounded.update(partial.clipped)
        self.notes.add(partial)

    def undecided(self, device: str) -> bool:
        return False  # a site decided each of its devices' verdicts before its partial came up

    def report(self) -> FoldReport:
        return FoldReport(self.count, dict(self.clipped), dict(self.centered), dict(self.gated),
                          dict(self.discounted), unvoted=self.unvoted, bounded=Counter(self.bounded), reports=self.notes.reports,
                          bytes_down=self.notes.bytes_down)

    def result(self) -> dict[str, np.ndarray]:
        if self._mean is None:
            self._fold()
            self._mean = self.stream.mean()
            if self.votes is not None:
                self._mean, self.unvoted = self.votes.mask(self._mean)
        return self._mean

    def _fold(self) -> None:
        """The held partials, bounded (weight, then length), into the round's weighted sums."""
        if not self.partials:
            raise ValueError("no updates were folded in")
        per_device = statistics.median_low(w / n for _, n, w, _, _ in self.partials)
        center = {n: np.asarray(self.center[n], dtype=np.float64) if self.center is not None else 0.0
                  for n in self.specs}
        rows = []
        for site, n, w, steps, sums in self.partials:
            factor = (steps / w) if self.stream.normalize_steps else 1.0  # a partial's mean is factor * sums / w
            step = {name: a * (factor / w) for name, a in sums.items()}
            bounded = w if self.weighting == "reported" else min(w, n * self.weight_cap * per_device)
            if self.standing.get(site, 1.0) < 1:  # clipped in earlier rounds (see trust.NormBound.stand)
                self.discounted[f"site {site}"] = (self.standing[site], "its partials were clipped before")
                bounded *= self.standing[site]
            if bounded < w:
                self.weighed[f"site {site}"] = (w, bounded)
                self.bounded["site_weight"] += 1
                log.warning("round %d: partial from site %s: weight %.4g for %d updates bounded to %.4g (%gx the "
                            "median per-update weight of the round's partials)", self.round_no, site, w, n, bounded,
                            self.weight_cap)
            offset = {name: step[name] - center[name] for name in step}
            rows.append((site, bounded, steps * bounded / w, step, offset, l2(offset)))
        radius = (self.norm_bound * statistics.median(r[5] for r in rows)
                  if self.norm_bound > 0 and len(rows) >= 3 else None)
        outside = StreamingMean(self.specs, self.stream.normalize_steps)
        for site, w, steps, step, offset, distance in rows:
            clipped = radius is not None and distance > radius
            if radius is not None:
                kept = self.standing.get(site, 1.0)
                kept = max(MIN_STANDING, kept * radius / distance) if clipped else min(1.0, kept * GROWTH)
                if kept < 1:
                    self.standing[site] = kept
                else:
                    self.standing.pop(site, None)
            if clipped:
                self.centered[f"site {site}"] = (distance, radius)
                self.bounded["site_center"] += 1
                log.warning("round %d: partial from site %s: its mean step lies %.4g from the centre, clipped to "
                            "%.4g (%gx the median of the round's partials)", self.round_no, site, distance, radius,
                            self.norm_bound)
                step = {name: center[name] + offset[name] * (radius / distance) for name in step}
            # back to sums that carry this mean with the bounded weight (same steps per weight)
            target = outside if clipped and self.outlier_share is not None else self.stream
            factor = (steps / w) if self.stream.normalize_steps else 1.0
            target.merge({name: a * (w / factor) for name, a in step.items()}, w, steps, 0)
        self.stream.count = self.count  # devices, as a flat round counts them
        if outside.total_weight > 0:
            inside = self.stream.total_weight
            share = self.outlier_share or 0.0
            scale = 1.0 if inside == 0 else min(1.0, share / (1 - share) * inside / outside.total_weight)
            self.stream.merge({name: a * scale for name, a in outside.sums.items()}, outside.total_weight * scale,
                              outside.weighted_steps * scale, 0)


def l2(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(a))) for a in tensors.values())))
