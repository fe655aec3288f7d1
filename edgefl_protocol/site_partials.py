"""What crosses a site's bridge per round: the coordinator's site task down, one signed partial per
aggregator worker up (the topics: `topics.site_topic`).

A site task carries the round's device task payload verbatim (the site publishes the same bytes
to each device it selects, as the coordinator does in a flat federation), how many devices the
site should select, and the trust rules its workers apply. A partial is a worker's share of the
round: the weighted sum of the deltas it accepted (float32 on the wire; summed in float64 on
both sides), their total weight, weighted steps and count, the uniform sum of the algorithm's
extra tensors, a summary of the devices' metrics, and the rejections by reason. Its size does not
depend on how many devices answered, except for `observed`: the per-device signals a server rule
that keeps per-device state (e.g. dynsam's medians) needs; it is empty for rules that keep none.

A partial is signed like an update (`signing`), with the site's key: the bridge user's ACL lets a
site write only its own topics, and the signature makes a misconfigured ACL still not enough.
The centre's aggregate of partials is broker_coordinator.aggregation.tree_sum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edgefl_protocol import codec, compression, messages, signing
from edgefl_protocol.errors import Rejected
from edgefl_protocol.messages import typed_field, unpack  # the same header checks as every message

MAX_SUMMARY_KEYS = 64
MAX_OBSERVED = 100_000
VOTES = "votes."  # a decoded partial's net sign votes, beside its sums (never a tensor name: names have no trailing dot)


class Sums(Protocol):
    """A fold's weighted sums, as broker_coordinator.aggregation.streaming.StreamingMean keeps them."""

    sums: Mapping[str, np.ndarray]
    count: int
    total_weight: float
    weighted_steps: float


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
    # root_trust: the update the coordinator trained on its root data this round, coded like the centre;
    # empty: none (a worker of an earlier release ignores it)
    trust_specs: list = field(default_factory=list)
    trust: bytes = b""


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
    """Bytes: the largest site task a worker accepts (the device task and rules, the centre and the
    root update)."""
    return (1 << 20) + 8 * sum(math.prod(shape) for shape in specs.values())


def decode_site_task(data: bytes, max_bytes: int = 1 << 20) -> SiteTask:
    obj = unpack(data, "site_task", max_bytes)
    task = SiteTask(typed_field(obj, "round", int), typed_field(obj, "attempt", int),
                    typed_field(obj, "clients", int), typed_field(obj, "task", bytes), obj.get("rules") or {},
                    obj.get("center_specs") or [], obj.get("center") or b"", obj.get("trust_specs") or [],
                    obj.get("trust") or b"")
    if task.clients < 0 or not isinstance(task.rules, dict):
        raise Rejected("schema", "site task: clients must be >= 0 and rules a map")
    if not isinstance(task.center_specs, list) or not isinstance(task.center, bytes):
        raise Rejected("schema", "site task: center_specs must be a list and center bytes")
    if not isinstance(task.trust_specs, list) or not isinstance(task.trust, bytes):
        raise Rejected("schema", "site task: trust_specs must be a list and trust bytes")
    return task


def encode_center(center: Mapping[str, np.ndarray] | None) -> tuple[list, bytes]:
    if center is None:
        return [], b""
    encoded = codec.encode(center, "float32")
    return encoded.specs, encoded.body


def decode_center(task: SiteTask, specs: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The site task's centre with the model's shapes and finite values, or None. Raises Rejected."""
    return _decode_tensors(task.center_specs, task.center, specs)


def decode_trust(task: SiteTask, specs: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The site task's root update with the model's shapes and finite values, or None. Raises Rejected."""
    return _decode_tensors(task.trust_specs, task.trust, specs)


def _decode_tensors(coded_specs: list, body: bytes, specs: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    if not body:
        return None
    return codec.decode("float32", coded_specs, body, dict(specs), sum(math.prod(s) for s in specs.values()))


# partials ----------------------------------------------------------------------------------------
def make_partial(fed: str, site: str, worker: int, round_no: int, attempt: int, model_version: int,
                 stream: Sums, extras: Sums | None, **info: Any) -> Partial:
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
    obj = unpack(signing.verify(data, key, f"site {site}"), "partial", max_bytes)
    p = Partial(
        federation=typed_field(obj, "federation", str), site=typed_field(obj, "site", str),
        worker=typed_field(obj, "worker", int),
        round=typed_field(obj, "round", int), attempt=typed_field(obj, "attempt", int),
        model_version=typed_field(obj, "model_version", int), count=typed_field(obj, "count", int),
        total_weight=float(typed_field(obj, "total_weight", (int, float))),
        weighted_steps=float(typed_field(obj, "weighted_steps", (int, float))),
        extras_count=typed_field(obj, "extras_count", int), specs=typed_field(obj, "specs", list),
        body=typed_field(obj, "body", bytes),
        rejected=_counts(obj, "rejected"), refused=typed_field(obj, "refused", int), clipped=_counts(obj, "clipped"),
        bytes_up=typed_field(obj, "bytes_up", int), summary=_summary(obj), observed=_observed(obj),
        selected=typed_field(obj, "selected", int), evaluation=_evaluation(obj),
        clip=float(typed_field(obj, "clip", (int, float))) if "clip" in obj else 0.0,
        unclipped=typed_field(obj, "unclipped", int) if "unclipped" in obj else 0,
        votes=typed_field(obj, "votes", bytes) if "votes" in obj else b"",
        voters=typed_field(obj, "voters", int) if "voters" in obj else 0)
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


# a partial's sign votes (broker_coordinator.aggregation.votes): the net counts, int32 little-endian,
# compressed as tensor bodies are (most are small: a few hundred KB of zeros and ones compress to tens)
def encode_net(net: np.ndarray) -> bytes:
    return compression.compress(np.asarray(net, dtype="<i4").tobytes(), "zlib")


def decode_net(data: bytes, size: int) -> np.ndarray:
    """A partial's net votes, exactly `size` of them. Raises Rejected."""
    raw = compression.decompress(data, "zlib", 4 * size)
    if len(raw) != 4 * size:
        raise Rejected("schema", f"partial: votes must be {size} int32 counts, one per parameter")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)
