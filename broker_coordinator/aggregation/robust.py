"""One round's fold of client deltas, robust to the devices that lie.

Every delta is first scaled down to the adaptive norm bound (`trust.NormBound`),
then combined by one of (`RoundSettings.aggregator`):

- `centered_clip` (default): centered clipping (Karimireddy, He and Jaggi,
  ICML 2021). Each delta's difference from a centre `c` that every level of
  the federation knows before the round opens (the last applied aggregate
  step, see `Engine.center`) is clipped to a radius tau, and the round
  averages c + clip(delta - c, tau):
      aggregate = c + sum_k w_k min(1, tau / ||delta_k - c||) (delta_k - c) / sum_k w_k
  tau is `norm_bound` times the median of the devices' recent (clipped)
  distances from their round's centre (a second `NormBound`), fixed when the
  round opens, so the fold does not depend on the order of arrival. A reversed or
  crafted update lies far from c and counts at most tau; honest deltas of a
  converging federation lie near it. The updates the radius clipped share at
  most `OUTLIER_SHARE` of the round's weight (their weights are scaled down
  together when the round closes, never to zero): one update outside the
  radius then pulls a round of 4 no further than a round of 20, where it
  would hold 1/20 of the weight anyway (5%: in clean runs of bench/attacks.py
  the radius clips about 3% of honest updates, so the cap rarely touches
  them). And a device the radius keeps
  clipping loses standing: its weight is multiplied by the product of its
  recent radius / distance ratios (at least `MIN_STANDING`; each update inside
  the radius doubles it back, up to 1), so a persistent attacker fades while
  an honest device clipped once is whole again at its next update. A length
  does not say which way an update points: a sign- or label-flipped update can
  sit inside both bounds. So each update also leaves a sketch, and when the
  round closes the updates whose median cosine with the others points away from
  the round's majority are flagged; a device's weight from then on falls with
  its recent flags (`consensus.py`). Each update is judged as it arrives, by
  the same rule at a site and at the centre, so the fold streams: memory
  O(model) (plus a 2,048-number sketch per update of the round) at any cohort
  size. With `verdict_banks` (`banks.py`) the round's flags also hold back
  its own flagged updates, from N partial sums instead of one. Without a
  centre (the first round) it holds its first `warmup` updates and centres on
  their coordinate-wise median (`_provisional_center`), with a radius from
  their distances to it; with fewer than PROVISIONAL_MIN updates in all, the
  clipped mean, weighed by the same standing.
- `mean`: the weighted mean of the norm-bounded deltas, streamed.
- `gated_mean`: the weighted mean of the deltas that point the same way as
  the round's coordinate-wise median (cosine > 0), at least the most aligned
  half. Holds the round's deltas: memory O(cohort x model); flat rounds only.
- `trimmed_mean`: per coordinate, drop the `trim` fraction of largest and of
  smallest values, average the rest (Yin et al., ICML 2018). Unweighted.
- `median`: per coordinate median (Yin et al., ICML 2018). Unweighted.

The last three hold the round's deltas (memory O(cohort x model)) and ignore
sample weights and step normalization: that is their price, and why they
cannot run at a site (a partial carries sums, not the deltas a median needs).

Either streaming fold may weigh each update by its cosine with the update the
coordinator trained on its root data (`root_trust`, `_trusted`; FLTrust), and
leave out those at 0 or below.

Either streaming fold may add sign votes (`sign_quorum` > 0, `votes.py`): each bounded delta
votes the sign of every parameter it moves, and the round's aggregate keeps only the parameters
that enough of its updates agree on (off by default: docs/RESEARCH.md has what it stops and costs).

A cold start (fewer than `warmup` norms known) holds at most `warmup`
updates, clips them against the median of their own norms, and streams from
then on: the streaming folds stay O(model) from the first round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from broker_coordinator.aggregation.banks import VerdictBanks
from broker_coordinator.aggregation.consensus import Consensus
from broker_coordinator.aggregation.fold import MEDIAN, FoldReport
from broker_coordinator.aggregation.held_folds import geometric_median, trimmed_mean
from broker_coordinator.aggregation.reference import dot_with
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import FLOOR, MIN_STANDING, NormBound
from broker_coordinator.aggregation.votes import SignVotes
from broker_coordinator.settings.choices import (
    AGGREGATORS,
    DEFAULT_AGGREGATOR,
    STREAMING,
)
from edgefl_protocol.sparse_delta import SparseDelta

AWAY = "its updates pointed away from their rounds before (agreement)"
OUTSIDE = "its updates lay outside the centre's radius before"
LONG = "its updates were far longer than the norm bound before"
# centered_clip: an update over this many times the norm bound is a strike against its device (honest updates
# reached 2.4x at the 99th percentile in bench/attacks.py, sign flips 3-60x), costing bound / norm from the second
LENGTH_STRIKE = 3.0
PROVISIONAL_MIN = 3  # held updates for a first round's provisional centre: the median of fewer is their mean
OUTLIER_SHARE = 0.05  # centered_clip: the largest share of a round's weight the radius-clipped updates hold


@dataclass
class Held:
    device: str
    delta: dict[str, np.ndarray]
    weight: float
    steps: int
    norm: float


def l2_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """BLAS's float32 dot per tensor (it accumulates more precisely than float32; 1e-9 relative on the
    CNN), summed in a Python float: about 30 us for the 80k CNN, against 140 us for a float64 copy.
    It relies on one BLAS thread, which `broker_coordinator` sets before numpy loads: a dot this size
    handed to OpenBLAS's thread pool waited milliseconds per call on busy cores (bench/runtime.py)."""
    if isinstance(tensors, SparseDelta):
        return tensors.norm()
    total = 0.0
    for a in tensors.values():
        x = np.asarray(a, dtype=np.float32).ravel()
        total += float(np.dot(x, x))
    return float(np.sqrt(total))


class RobustRound:
    def __init__(self, specs: Mapping[str, tuple[int, ...]], bound: NormBound, aggregator: str = DEFAULT_AGGREGATOR,
                 trim: float = 0.2, normalize_steps: bool = False,
                 reference: Callable[[list[str]], np.ndarray] | None = None,
                 center: Mapping[str, np.ndarray] | None = None, radius: NormBound | None = None,
                 consensus: Consensus | None = None, sign_quorum: float = 0.0, verdict_banks: int = 0,
                 trust: Callable[[list[str]], np.ndarray] | None = None) -> None:
        """`reference(names)`, if given, is gated_mean's direction (flattened in the order of `names`)
        instead of the round's coordinate-wise median (see `reference.py`). `center`, `radius` and
        `consensus` are centered_clip's centre (None: none yet), the adaptive radius' history and the
        devices' standing by agreement with their rounds (see `consensus.py`); `verdict_banks` > 0 lets
        that verdict act on the round's own updates too (see `banks.py`). `trust(names)`, if given, is the
        update the coordinator trained on its root data this round (`root_trust`, see `_trusted`)."""
        if aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {aggregator!r}")
        self.specs, self.bound, self.aggregator, self.trim = dict(specs), bound, aggregator, trim
        self.reference = reference
        self.center = ({n: np.asarray(center[n], dtype=np.float32) for n in self.specs}
                       if center is not None and aggregator == "centered_clip" else None)
        self.radius = radius if radius is not None else NormBound.radius(bound.multiplier)
        self.consensus = (consensus if consensus is not None else Consensus()) if aggregator == "centered_clip" else None
        self.sketches: dict[str, np.ndarray] = {}  # centered_clip: device -> sketch of its bounded delta
        # centered_clip: the inside updates in partial sums, so that the round's flags reach its own updates
        self.banks = (VerdictBanks(specs, verdict_banks, normalize_steps)
                      if verdict_banks > 0 and self.consensus is not None else None)
        self.held_back: dict[str, float] = {}  # device -> its bank's scale, for the updates a flag held back
        self.disagreeing: dict[str, float] | None = None  # device -> median cosine, once the round is judged
        # fixed for the round, so the fold does not depend on the order updates arrive in, and a site
        # given the same history clips exactly as the centre would (None: too few distances known yet)
        self.tau = self.radius.bound() if self.center is not None else None
        self._center_flat: np.ndarray | None = None  # the centre as one float64 vector, and its squared norm
        self._center_square = 0.0
        self.stream = StreamingMean(specs, normalize_steps=normalize_steps)
        # centered_clip: the updates the radius clipped, folded in with `outlier_scale` when the round closes
        self.outliers = StreamingMean(specs, normalize_steps=normalize_steps)
        self.outlier_scale: float | None = None  # the factor their weights got (None: not settled yet)
        self.held: list[Held] = []
        self.clipped: dict[str, tuple[float, float]] = {}  # device -> (norm, bound) of every clipped delta
        self.centered: dict[str, tuple[float, float]] = {}  # device -> (distance, radius) of every centre-clipped one
        self.gated: dict[str, float] = {}  # device -> cosine with the round's median, for every dropped delta
        # device -> (the share of its weight its standing kept, why): flags of earlier rounds
        self.discounted: dict[str, tuple[float, str]] = {}
        self.floored: set[str] = set()  # devices whose standing from earlier rounds is at MIN_STANDING
        self.trust = trust
        self._root: np.ndarray | None = None  # trust's update, flattened in the order of specs (computed once)
        self._root_norm = 0.0
        self.gated_by = MEDIAN  # what a left-out update's cosine was taken with
        self.count = 0
        # centered_clip with no centre yet (the first round): hold the first updates for one (see _flush_held)
        self._awaiting_center = self.consensus is not None and self.center is None
        self.provisional = False  # the round's centre is the median of its first updates, not a last step
        self.votes = SignVotes(specs, sign_quorum) if sign_quorum > 0 and self.streaming else None
        self.unvoted: float | None = None  # the fraction of coordinates the votes held still, once closed

    @property
    def streaming(self) -> bool:
        return self.aggregator in STREAMING

    def undecided(self, device: str) -> bool:
        return any(h.device == device for h in self.held)

    def report(self) -> FoldReport:
        return FoldReport(self.count, dict(self.clipped), dict(self.centered), dict(self.gated),
                          dict(self.discounted), dict(self.disagreeing or {}), dict(self.held_back),
                          judged_kin=self.consensus is not None, unvoted=self.unvoted, gated_by=self.gated_by,
                          floored=set(self.floored))

    def add(self, device: str, delta: Mapping[str, np.ndarray], weight: float, steps: int = 1,
            norm: float | None = None) -> None:
        """`norm`: the delta's L2 norm if the caller has it already (intake's hard bound)."""
        if not weight > 0:
            raise ValueError(f"aggregation weight must be positive, got {weight}")
        norm = l2_norm(delta) if norm is None else norm
        self.count += 1
        bound = self.bound.bound()
        if self.streaming and (bound is not None or not self.bound.enabled) and not self._awaiting_center:
            self._stream(device, delta, norm, bound, weight, steps)
            return
        self.held.append(Held(device, {n: np.asarray(a, dtype=np.float32) for n, a in delta.items()},
                              weight, steps, norm))
        if self.streaming and len(self.held) >= self.bound.warmup:
            self._flush_held()  # a cold start holds at most `warmup` updates

    def _stream(self, device: str, delta: Mapping[str, np.ndarray], norm: float, bound: float | None,
                weight: float, steps: int) -> None:
        clipped = self._clip(device, delta, norm, bound)
        self._fold(device, clipped, weight, steps)

    def _fold(self, device: str, delta: Mapping[str, np.ndarray], weight: float, steps: int) -> None:
        trusted = 1.0
        if self.trust is not None:
            trusted = self._trusted(delta)
            if trusted <= 0:
                self.gated[device] = trusted
                return
        if self.votes is not None:
            self.votes.add(delta)
        agreement = 1.0
        if self.consensus is not None:
            self.sketches[device] = self.consensus.sketch(self.specs, delta)
            agreement = self.consensus.of(device)  # from earlier rounds, like the radius' standing
        # from earlier rounds (the fold keeps its order), and the root update's word on this one
        radius = self.radius.standing.get(device, 1.0) if self.center is not None else 1.0
        length = self.bound.standing.get(device, 1.0) if self.consensus is not None else 1.0
        kept = max(radius * agreement * length, MIN_STANDING)
        if kept <= MIN_STANDING:
            self.floored.add(device)
        standing = kept * trusted
        if standing < 1:
            self.discounted[device] = (standing, "; ".join(
                why for why, low in ((AWAY, agreement < 1), (OUTSIDE, radius < 1), (LONG, length < 1),
                                     (f"its cosine with the root update is {trusted:.2f}", trusted < 1)) if low))
        if self.consensus is not None and self.bound.enabled:  # centered_clip: a length far past the bound
            norm, bound = self.clipped.get(device, (0.0, 1.0))
            self.bound.stand(device, bound / norm if norm > LENGTH_STRIKE * bound else 1.0)
        if self.center is None:
            self._inside(device, delta, weight * standing, steps)
            return
        centered = self._center(device, delta)
        outside = self.centered.get(device)
        if self.tau is not None:
            self.radius.stand(device, outside[1] / outside[0] if outside else 1.0)
        if outside:
            self.outliers.add(centered, weight * standing, steps)
        else:
            self._inside(device, centered, weight * standing, steps)

    def _trusted(self, delta: Mapping[str, np.ndarray]) -> float:
        """FLTrust's score (Cao et al., NDSS 2021): the update's cosine with the root update, the
        direction the coordinator's own training on clean data took from the same model. An update
        at 0 or below is left out; the others weigh their cosine (their sample weight times it), so
        an attacker must point where clean data points to count, whatever the round's majority."""
        if self._root is None:
            assert self.trust is not None
            self._root = np.asarray(self.trust(list(self.specs)), dtype=np.float32)
            self._root_norm = float(np.linalg.norm(self._root))
            self.gated_by = "the root update"
        return dot_with(delta, self._root, list(self.specs)) / max(l2_norm(delta) * self._root_norm, 1e-12)

    def _inside(self, device: str, delta: Mapping[str, np.ndarray], weight: float, steps: int) -> None:
        if self.banks is not None:
            self.banks.add(device, delta, weight, steps)
        else:
            self.stream.add(delta, weight, steps)

    def _clip(self, device: str, delta: Mapping[str, np.ndarray], norm: float,
              bound: float | None) -> Mapping[str, np.ndarray]:
        if bound is None:
            return delta
        self.bound.observe(norm, device, bound)
        if norm <= bound:
            return delta
        self.clipped[device] = (norm, bound)
        scale = bound / norm
        if isinstance(delta, SparseDelta):
            return delta.scaled(scale)
        return {name: a * scale for name, a in delta.items()}

    def _center(self, device: str, delta: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """c + clip(delta - c, tau), tau from the distances of earlier rounds (none while they are few)."""
        assert self.center is not None
        if isinstance(delta, SparseDelta) and delta.names == tuple(self.specs):
            distance = self._sparse_distance(delta)
            if self.tau is None or distance <= self.tau:
                self.radius.observe(distance, device, self.tau)
                return delta
        offset = {name: np.asarray(delta[name], dtype=np.float32) - self.center[name] for name in self.specs}
        distance = l2_norm(offset)
        tau = self.tau
        self.radius.observe(distance, device, tau)
        if tau is None or distance <= tau:
            return delta
        self.centered[device] = (distance, tau)
        scale = tau / distance
        return {name: self.center[name] + offset[name] * scale for name in self.specs}

    def _sparse_distance(self, delta: SparseDelta) -> float:
        """|delta - c| from the nonzeros: |c|^2 plus, where delta is nonzero, (d - c)^2 - c^2 (float64)."""
        if self._center_flat is None:
            self._center_flat = np.concatenate([np.ravel(self.center[n]) for n in self.specs]).astype(np.float64)
            self._center_square = float(np.dot(self._center_flat, self._center_flat))
        c = self._center_flat[delta.positions]
        offset = delta.values - c
        return float(np.sqrt(max(self._center_square + float(np.dot(offset, offset)) - float(np.dot(c, c)), 0.0)))

    def _flush_held(self) -> None:
        """Clip the held (cold-start) deltas against their own median norm and stream them; in a
        centered_clip round without a centre, against the provisional centre they give."""
        clipped = self._clip_held()
        if self._awaiting_center:
            self._awaiting_center = False
            if len(clipped) >= PROVISIONAL_MIN:
                self._provisional_center(clipped)
        for h, delta in clipped:
            self._fold(h.device, delta, h.weight, h.steps)

    def _provisional_center(self, clipped: list[tuple[Held, Mapping[str, np.ndarray]]]) -> None:
        """The first round has no last step to centre on, and a clipped mean of it is what an attacker
        moves most (20% sign flips cost the served model 20-59 points after round 2 in bench/attacks.py).
        Its first updates' coordinate-wise median is a centre a minority cannot move far, and the
        radius is the norm bound's multiplier times their median distance from it (the radius'
        history, when a site or a resumed coordinator has one)."""
        self.center = {n: np.median(np.stack([np.asarray(d[n], dtype=np.float32) for _, d in clipped]), axis=0)
                       .astype(np.float32) for n in self.specs}
        self._center_flat = None
        distances = [l2_norm({n: np.asarray(d[n], dtype=np.float32) - self.center[n] for n in self.specs})
                     for _, d in clipped]
        self.tau = self.radius.bound() or self.radius.multiplier * max(float(np.median(distances)), FLOOR)
        self.provisional = True

    def result(self) -> dict[str, np.ndarray]:
        """The round's aggregate delta (called once, when the round closes)."""
        if self.count == 0:
            raise ValueError("no updates were folded in")
        if self.streaming:
            stream = self.streamed()
            if stream.count == 0:  # every update was left out (root_trust): the model stays where it is
                return {n: np.zeros(shape, np.float32) for n, shape in self.specs.items()}
            aggregate = stream.mean()
            if self.votes is not None:
                aggregate, self.unvoted = self.votes.mask(aggregate)
            return aggregate
        clipped = self._clip_held()
        if self.aggregator == "gated_mean":
            for h, delta in self._gate(clipped):
                self.stream.add(delta, h.weight, h.steps)
            return self.stream.mean()
        if self.aggregator == "geomed":
            return self._geometric_median(clipped)
        out = {}
        for name in self.specs:
            stack = np.stack([delta[name] for _, delta in clipped]).astype(np.float64)
            out[name] = (np.median(stack, axis=0) if self.aggregator == "median"
                         else trimmed_mean(stack, self.trim)).astype(np.float32)
        return out

    def _geometric_median(self, clipped: list[tuple[Held, Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
        names = list(self.specs)
        flat = np.stack([np.concatenate([np.ravel(d[n]) for n in names]) for _, d in clipped]).astype(np.float64)
        z = geometric_median(flat, np.array([h.weight for h, _ in clipped], dtype=np.float64))
        out, start = {}, 0
        for n in names:
            size = int(np.prod(self.specs[n]))
            out[n] = z[start:start + size].reshape(self.specs[n]).astype(np.float32)
            start += size
        return out

    def _clip_held(self) -> list[tuple[Held, Mapping[str, np.ndarray]]]:
        bound = self.bound.bound([h.norm for h in self.held]) if self.held else None
        clipped = [(h, self._clip(h.device, h.delta, h.norm, bound)) for h in self.held]
        self.held = []
        return clipped

    def streamed(self) -> StreamingMean:
        """A streaming fold's weighted sums, any held (cold-start) deltas folded in: what a site
        aggregator sends up instead of the mean (see `partials`)."""
        if not self.streaming:
            raise ValueError(f"only the streaming folds ({', '.join(STREAMING)}) reduce to sums, "
                             f"not {self.aggregator!r}")
        self._flush_held()
        if self.consensus is not None and self.disagreeing is None:
            self.disagreeing = self.consensus.judge(self.sketches)
            self.sketches = {}
        if self.banks is not None:
            self.held_back = self.banks.settle(self.stream, set(self.disagreeing or ()) | set(self.consensus.kin))
            self.banks = None
        self._settle_outliers()
        return self.stream

    def _settle_outliers(self) -> None:
        """Fold the radius-clipped updates in, their weights scaled so that they hold at most
        OUTLIER_SHARE of the round's (all of it when nothing inside the radius came in)."""
        if self.outliers.count == 0:
            return
        inside = self.stream.total_weight
        cap = OUTLIER_SHARE / (1 - OUTLIER_SHARE) * inside
        scale = 1.0 if inside == 0 else min(1.0, cap / self.outliers.total_weight)
        self.outlier_scale = scale
        self.stream.merge({n: a * scale for n, a in self.outliers.sums.items()}, self.outliers.total_weight * scale,
                          self.outliers.weighted_steps * scale, self.outliers.count)
        self.outliers = StreamingMean(self.specs, normalize_steps=self.stream.normalize_steps)

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
