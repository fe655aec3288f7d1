"""What crosses a site's bridge per round: the coordinator's site task down, one signed partial per
aggregator worker up.

A site task carries the round's device task payload verbatim (the site publishes the same bytes
to each device it selects, as the coordinator does in a flat federation), how many devices the
site should select, and the trust rules its workers apply. A partial is a worker's share of the
round: the weighted sum of the deltas it accepted (float32 on the wire; summed in float64 on
both sides), their total weight, weighted steps and count, the uniform sum of the algorithm's
extra tensors, a summary of the devices' metrics, and the rejections by reason. Its size does not
depend on how many devices answered, except for `observed`: the per-device signals a server rule
that keeps per-device state (e.g. dynsam's medians) needs; it is empty for rules that keep none.

    edgefl/<fed>/site/<site>/task        coordinator -> site (queued for the bridge's session while it is down)
    edgefl/<fed>/site/<site>/status      site -> coordinator, retained: devices online and eligible
    edgefl/<fed>/site/<site>/partial     site -> coordinator: one per worker per round attempt
    edgefl/<fed>/site/<site>/cohort      site-local, retained: the devices the site tasked

A partial is signed like an update (`signing`), with the site's key: the bridge user's ACL lets a
site write only its own topics, and the signature makes a misconfigured ACL still not enough.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import GROWTH, MIN_STANDING
from broker_coordinator.aggregation.votes import SignVotes, decode_net
from edgefl_protocol import codec, messages, signing, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.messages import (  # the same header checks as every message
    _field,
    _unpack,
)

log = logging.getLogger("broker_coordinator")
EXTRA = "extra."  # tensors the algorithm sends beside the delta (edgefl_protocol.algorithms.base.EXTRA_PREFIX)
MAX_SUMMARY_KEYS = 64
MAX_OBSERVED = 100_000
VOTES = "votes."  # a decoded partial's net sign votes, beside its sums (never a tensor name: names have no trailing dot)


def site_topic(fed: str, site: str, kind: str) -> str:
    return f"{topics.ROOT}/{fed}/site/{site}/{kind}"


def all_site_topics(fed: str, kind: str) -> str:
    return f"{topics.ROOT}/{fed}/site/+/{kind}"


def parse_site_topic(topic: str) -> tuple[str, str, str] | None:
    """`edgefl/<fed>/site/<site>/<kind>` -> (fed, site, kind); None for anything else."""
    parts = topic.split("/")
    if len(parts) != 5 or parts[0] != topics.ROOT or parts[2] != "site":
        return None
    return parts[1], parts[3], parts[4]


@dataclass
class SiteTask:
    round: int
    attempt: int
    clients: int  # devices the site selects; 0 = every eligible device
    task: bytes  # the encoded messages.Task every selected device receives
    rules: dict[str, Any] = field(default_factory=dict)  # RoundSettings trust fields the workers apply
    # centered_clip's centre for the round (the last applied step), float32-coded; empty: none yet
    center_specs: list = field(default_factory=list)
    center: bytes = b""


@dataclass
class Partial:
    federation: str
    site: str
    worker: int
    round: int
    attempt: int
    model_version: int
    count: int  # deltas folded in
    total_weight: float
    weighted_steps: float
    extras_count: int
    specs: list  # [[name, [dims]], ...] of `body` (float32 codec): model tensors, then "extra." ones
    body: bytes
    rejected: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    clipped: dict[str, int] = field(default_factory=dict)
    bytes_up: int = 0
    summary: dict[str, list] = field(default_factory=dict)  # metric -> [count, sum, min, max]
    observed: list = field(default_factory=list)  # [[device, num_samples, {metric: value}], ...]
    selected: int = 0  # devices the site tasked (reported by worker 0 only)
    evaluation: list = field(default_factory=list)  # [sum score*n, sum loss*n, n, devices] of device evaluations
    # [privacy] (private_partials): the clip C every delta was clipped to (0: not a private fold) and
    # how many of the `count` deltas were under it, exact (the centre releases it with noise)
    clip: float = 0.0
    unclipped: int = 0
    # sign_quorum (votes.py): the net sign votes of the worker's `voters` deltas, per parameter; empty: off
    votes: bytes = b""
    voters: int = 0


def encode_site_task(task: SiteTask) -> bytes:
    return messages.encode("site_task", task)


def site_task_cap(specs: Mapping[str, tuple[int, ...]]) -> int:
    """Bytes: the largest site task a worker accepts (the device task and rules, and the centre)."""
    return (1 << 20) + 4 * sum(math.prod(shape) for shape in specs.values())


def decode_site_task(data: bytes, max_bytes: int = 1 << 20) -> SiteTask:
    obj = _unpack(data, "site_task", max_bytes)
    task = SiteTask(_field(obj, "round", int), _field(obj, "attempt", int), _field(obj, "clients", int),
                    _field(obj, "task", bytes), obj.get("rules") or {}, obj.get("center_specs") or [],
                    obj.get("center") or b"")
    if task.clients < 0 or not isinstance(task.rules, dict):
        raise Rejected("schema", "site task: clients must be >= 0 and rules a map")
    if not isinstance(task.center_specs, list) or not isinstance(task.center, bytes):
        raise Rejected("schema", "site task: center_specs must be a list and center bytes")
    return task


def encode_center(center: Mapping[str, np.ndarray] | None) -> tuple[list, bytes]:
    if center is None:
        return [], b""
    encoded = codec.encode(center, "float32")
    return encoded.specs, encoded.body


def decode_center(task: SiteTask, specs: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The site task's centre with the model's shapes and finite values, or None. Raises Rejected."""
    if not task.center:
        return None
    return codec.decode("float32", task.center_specs, task.center, dict(specs), sum(math.prod(s) for s in specs.values()))


# partials ----------------------------------------------------------------------------------------
def make_partial(fed: str, site: str, worker: int, round_no: int, attempt: int, model_version: int,
                 stream: StreamingMean, extras: StreamingMean | None, **info: Any) -> Partial:
    """A worker's share of a round from its fold (`stream`: the weighted sums; `extras`: uniform)."""
    tensors = {name: acc.astype(np.float32) for name, acc in stream.sums.items()}
    if extras is not None and extras.count:
        tensors.update({name: acc.astype(np.float32) for name, acc in extras.sums.items()})
    encoded = codec.encode(tensors, "float32")
    return Partial(fed, site, worker, round_no, attempt, model_version, stream.count, stream.total_weight,
                   stream.weighted_steps, extras.count if extras is not None and extras.count else 0, encoded.specs,
                   encoded.body, **info)


def encode_partial(partial: Partial, key: bytes) -> bytes:
    return signing.sign(messages.encode("partial", partial), key)


def decode_partial(data: bytes, key: bytes | None, site: str, specs: Mapping[str, tuple[int, ...]],
                   extra_specs: Mapping[str, tuple[int, ...]], max_bytes: int) -> tuple[Partial, dict[str, np.ndarray]]:
    """Size cap, the site's signature, then every field; the tensors must have the model's shapes
    and be finite. Raises Rejected."""
    if len(data) > max_bytes:
        raise Rejected("oversized", f"partial of {len(data)} bytes exceeds the cap of {max_bytes}")
    obj = _unpack(signing.verify(data, key, f"site {site}"), "partial", max_bytes)
    p = Partial(
        federation=_field(obj, "federation", str), site=_field(obj, "site", str), worker=_field(obj, "worker", int),
        round=_field(obj, "round", int), attempt=_field(obj, "attempt", int),
        model_version=_field(obj, "model_version", int), count=_field(obj, "count", int),
        total_weight=float(_field(obj, "total_weight", (int, float))),
        weighted_steps=float(_field(obj, "weighted_steps", (int, float))),
        extras_count=_field(obj, "extras_count", int), specs=_field(obj, "specs", list), body=_field(obj, "body", bytes),
        rejected=_counts(obj, "rejected"), refused=_field(obj, "refused", int), clipped=_counts(obj, "clipped"),
        bytes_up=_field(obj, "bytes_up", int), summary=_summary(obj), observed=_observed(obj),
        selected=_field(obj, "selected", int), evaluation=_evaluation(obj),
        clip=float(_field(obj, "clip", (int, float))) if "clip" in obj else 0.0,
        unclipped=_field(obj, "unclipped", int) if "unclipped" in obj else 0,
        votes=_field(obj, "votes", bytes) if "votes" in obj else b"",
        voters=_field(obj, "voters", int) if "voters" in obj else 0)
    if p.site != site:
        raise Rejected("sender", f"topic says site {site} but the partial claims {p.site}")
    if min(p.worker, p.count, p.extras_count, p.refused, p.bytes_up, p.selected) < 0 or p.extras_count > p.count:
        raise Rejected("schema", "partial: worker and counts must be >= 0, extras_count <= count")
    if not (math.isfinite(p.total_weight) and math.isfinite(p.weighted_steps)):
        raise Rejected("non_finite", "partial: total weight or weighted steps is not finite")
    if not (math.isfinite(p.clip) and p.clip >= 0 and 0 <= p.unclipped <= p.count):
        raise Rejected("schema", f"partial: clip {p.clip} must be finite and >= 0, and its unclipped count "
                                 f"{p.unclipped} between 0 and its count {p.count}")
    if not 0 <= p.voters <= p.count:
        raise Rejected("schema", f"partial: {p.voters} voters for {p.count} deltas")
    if (p.count == 0) != (p.total_weight == 0) or p.total_weight < 0 or p.weighted_steps < 0:
        raise Rejected("schema", f"partial: {p.count} deltas with total weight {p.total_weight}")
    expected = dict(specs) | (dict(extra_specs) if p.extras_count else {})
    sums = codec.decode("float32", p.specs, p.body, expected, sum(math.prod(s) for s in expected.values()))
    if p.votes:
        sums[VOTES] = decode_net(p.votes, sum(math.prod(s) for s in specs.values()))
    return p, sums


def _counts(obj: Mapping[str, Any], name: str) -> dict[str, int]:
    value = obj.get(name) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 0 for k, v in value.items()):
        raise Rejected("schema", f"field {name!r} must map reasons to counts")
    return value


def _evaluation(obj: Mapping[str, Any]) -> list:
    row = obj.get("evaluation") or []
    if row and not (isinstance(row, list) and len(row) == 4
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in row)
                    and row[2] > 0 and row[3] > 0):
        raise Rejected("schema", "evaluation must be [sum score*n, sum loss*n, n > 0, devices > 0] of finite numbers")
    return row


def pooled_evaluation(reports: Mapping[str, tuple[float, float, int]]) -> list:
    """Devices' evaluations (device -> score, loss, count) as sums a partial can carry."""
    valid = [r for r in reports.values() if r[2] > 0 and math.isfinite(r[0]) and math.isfinite(r[1])]
    if not valid:
        return []
    return [sum(s * n for s, _, n in valid), sum(loss * n for _, loss, n in valid), sum(n for *_, n in valid),
            len(valid)]


def _summary(obj: Mapping[str, Any]) -> dict[str, list]:
    value = obj.get("summary") or {}
    if not isinstance(value, dict):
        raise Rejected("schema", "field 'summary' must be a map")
    for key, row in value.items():
        if not (isinstance(key, str) and isinstance(row, list) and len(row) == 4
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in row)):
            raise Rejected("schema", "summary rows must be [count, sum, min, max] of finite numbers")
    return value


def _observed(obj: Mapping[str, Any]) -> list:
    rows = obj.get("observed") or []
    if not isinstance(rows, list) or len(rows) > MAX_OBSERVED:
        raise Rejected("schema", f"field 'observed' must be a list of at most {MAX_OBSERVED} rows")
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                and isinstance(row[1], int) and isinstance(row[2], dict)):
            raise Rejected("schema", "observed rows must be [device, num_samples, {metric: value}]")
    return rows


def summarize(metrics: Mapping[str, Mapping[str, Any]]) -> dict[str, list]:
    """Per numeric metric over the accepted devices: [count, sum, min, max]."""
    out: dict[str, list] = {}
    for values in metrics.values():
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            row = out.setdefault(key, [0, 0.0, float(value), float(value)])
            row[0] += 1
            row[1] += float(value)
            row[2], row[3] = min(row[2], float(value)), max(row[3], float(value))
        if len(out) >= MAX_SUMMARY_KEYS:
            break
    return out


class TreeSum:
    """The round's aggregate from partials, where a site is one more device of the centre.

    Quacks like `robust.RobustRound` where the coordinator reads it (`count`, `mean`, `clipped`,
    `centered`, `gated`). A partial is a claim as a device's update is, so the centre bounds it
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
        self.discounted: dict[str, float] = {}  # "site S" -> the standing its weight was multiplied by
        self.partials: list[tuple[str, int, float, float, dict[str, np.ndarray]]] = []  # site, count, W, steps, sums
        self.counted: Counter[str] = Counter()  # site -> devices counted so far this round
        self.clipped: dict[str, tuple[float, float]] = {}
        self.centered: dict[str, tuple[float, float]] = {}  # "site S" -> (distance, radius) of clipped partials
        self.weighed: dict[str, tuple[float, float]] = {}  # "site S" -> (claimed, bounded) weight
        self.gated: dict[str, float] = {}
        self.bounded: Counter[str] = Counter()  # what the sites clipped, by kind, and what the centre did
        self.summary: dict[str, list] = {}
        self.reports = 0  # devices whose evaluation the partials carry
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
        self.note(partial)

    def note(self, partial: Partial) -> None:
        """The partial's evaluations and device summaries (private_partials keeps these too)."""
        self.reports += int(partial.evaluation[3]) if partial.evaluation else 0
        for key, row in partial.summary.items():
            mine = self.summary.setdefault(key, [0, 0.0, row[2], row[3]])
            mine[0] += row[0]
            mine[1] += row[1]
            mine[2], mine[3] = min(mine[2], row[2]), max(mine[3], row[3])

    def mean(self) -> dict[str, np.ndarray]:
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
                self.discounted[f"site {site}"] = self.standing[site]
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
