"""Message schemas. Every message is one msgpack map:

    {"schema": <protocol version>, "kind": "task" | "update" | "refusal" | "report" | "receipt" | "model" | "delta" | "status",
     ...header fields...,
     "body": <bytes or absent>}

`schema` is the protocol version the message is written in (`protocol` says which versions this
release speaks and what differs between them); a reader refuses a version it does not speak, with
its reason.

Tensors ride in `body` as separately encoded bytes (see `codec`), described
by the header's `codec` and `specs`. An update is signed as a whole (see
`signing`): `encode_update` wraps the packed map in an HMAC-SHA256 with the
device's key and `decode_update` checks that tag before unpacking anything.
The global model travels as a small retained manifest (`model`) plus raw
chunks on their own retained topics, verified by sha256 after reassembly.
`decode_*` functions validate types and ranges and raise `Rejected` with a
reason; they never trust the sender.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from . import OLDEST_SCHEMA, SCHEMA_VERSION, signing
from .errors import Rejected
from .topics import check_name

Scalar = int | float | str | bool
MAX_HEADER_FIELDS = 64
MAX_CHAIN = 64  # retained downlink deltas a manifest may list
MAX_STRING = 256  # characters of a string scalar a device may report (a metric, a reason)


@dataclass
class Task:
    """The coordinator's order to one device for one round."""

    round: int
    model_version: int
    deadline: float  # unix seconds
    algorithm: str
    hparams: dict[str, Scalar] = field(default_factory=dict)
    broadcast: dict[str, Scalar] = field(default_factory=dict)
    codec: str = "float32"
    attempt: int = 1  # rounds are retried with a new cohort; an answer is for one attempt
    task: str = "classification"  # what the model learns: classification | regression (edgefl_models.objectives)
    loss: str = "cross_entropy"  # the loss to train with: cross_entropy | mse | mae
    evaluate: bool = False  # evaluate the received model on the held-out slice first (metrics eval_*)
    train: bool = True  # False: an evaluation-only round; answer with a `report`, no update
    protocol: int = field(default=SCHEMA_VERSION, metadata={"wire": False})  # the version it came in: answer in it


@dataclass
class Update:
    """A device's answer: the model delta plus what it measured."""

    device: str
    round: int
    model_version: int
    num_samples: int
    metrics: dict[str, Scalar]
    body: bytes  # codec-encoded delta (and any algorithm tensors)
    codec: str = "float32"
    specs: list = field(default_factory=list)  # [[name, [dims...]], ...] as codec.Encoded.specs
    federation: str = ""
    attempt: int = 1


@dataclass
class Refusal:
    """A device's signed 'no' to a task it will not run (e.g. settings out of its range)."""

    device: str
    round: int
    attempt: int
    reason: str
    detail: str
    federation: str = ""


@dataclass
class EvalReport:
    """A device's answer to an evaluation-only task: the received model's metric on its held-out slice."""

    device: str
    round: int
    attempt: int
    model_version: int
    metric: str
    score: float
    loss: float
    count: int  # held-out samples it was measured on
    federation: str = ""


@dataclass
class Receipt:
    """The coordinator's verdict on one answer: the device stops resending once it has it."""

    round: int
    attempt: int
    accepted: bool
    reason: str = ""  # the rejection reason; "" when accepted
    detail: str = ""  # why it was rejected, or what the fold did to it (e.g. "norm 2.1 -> 1.5")
    # what the fold made of an accepted update: folded | clipped | left_out | pending (a second
    # receipt with the final verdict follows); on a rejection, "not_folded" when the coordinator
    # vouches that it never accepted it. "" from a coordinator that predates verdicts.
    verdict: str = ""
    scale: float = 1.0  # clipped: the multiple of its delta the device commits (left_out: 0)
    protocol: int = field(default=SCHEMA_VERSION, metadata={"wire": False})



@dataclass
class ModelRelease:
    """The manifest of one global model version, published once and retained.

    The encoded tensors (`codec`, `specs`) are `size` bytes with digest
    `sha256`, split into `chunks` raw pieces of at most `chunk_bytes`, each on
    `topics.model_chunk(fed, version, i)` (retained).
    """

    version: int
    arch: str
    codec: str
    specs: list
    size: int
    sha256: str
    chunks: int
    chunk_bytes: int
    fingerprint: str = ""  # edgefl_models.architectures.fingerprint: parameter names, shapes and dtypes
    # downlink = "delta": [[v, first 16 hex digits of the sha256 of broadcast model v - 1], ...], one
    # per retained delta (see `delta_downlink`); a device holding one of those fetches deltas, not chunks
    chain: list = field(default_factory=list)


@dataclass
class ModelDelta:
    """Broadcast model `version` - broadcast model `version - 1`, retained on
    `topics.model_delta(fed, version)`: the model tensors' difference in a lossy
    `codec`, the server rule's tensors (`extra.*`) whole in float32 (`state`), and
    the sha256 of the model it applies to and of the result (see `delta_downlink`)."""

    version: int
    base_sha256: str
    sha256: str
    codec: str
    specs: list
    body: bytes
    state_specs: list
    state: bytes


@dataclass
class Status:
    device: str
    state: str  # "online" | "offline"
    profile: dict[str, Scalar] = field(default_factory=dict)


SPOKEN = range(OLDEST_SCHEMA, SCHEMA_VERSION + 1)
ANY_VERSION = ("upgrade",)  # kinds every release reads in any version (protocol.UpgradeNotice)


def encode(kind: str, message: Any, protocol: int = SCHEMA_VERSION) -> bytes:
    # shallow: no message nests a dataclass, and asdict's deep copy of every dict and list cost the
    # coordinator about 20 us per receipt; fields marked wire=False (the version a message came in) stay home
    body = {f.name: getattr(message, f.name) for f in fields(message) if f.metadata.get("wire", True)}
    return msgpack.packb({"schema": protocol, "kind": kind, **body}, use_bin_type=True)


def unpack(data: bytes, kind: str, max_bytes: int, also: tuple[str, ...] = ()) -> dict[str, Any]:
    """The header map of a `kind` message (or one of the kinds in `also`), checked before any field."""
    if len(data) > max_bytes:
        raise Rejected("oversized", f"{kind} message of {len(data)} bytes exceeds the cap of {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_map_len=MAX_HEADER_FIELDS)
    except Exception as exc:
        raise Rejected("malformed", f"{kind} message is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise Rejected("malformed", f"{kind} message must be a map")
    version = obj.get("schema")
    if version not in SPOKEN and not (obj.get("kind") in ANY_VERSION and isinstance(version, int)):
        raise Rejected("protocol", f"a {kind} message of protocol version {version!r}: this release speaks "
                                   f"{OLDEST_SCHEMA} to {SCHEMA_VERSION}; the side that sent it is "
                                   f"{'newer' if isinstance(version, int) and version > SCHEMA_VERSION else 'older'}"
                                   f" (upgrading: docs/OPERATOR.md)")
    if obj.get("kind") != kind and obj.get("kind") not in also:
        raise Rejected("schema", f"expected a {kind} message, got kind {obj.get('kind')!r}")
    return obj


def typed_field(obj: dict[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    """`obj[name]`, which must be present and of `types`, else Rejected (a bool is no number)."""
    value = obj.get(name)
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        value = None  # bool is an int subclass; never accept it where a number is meant
    if not isinstance(value, types):
        raise Rejected("schema", f"field {name!r} is missing or has the wrong type")
    return value


def _scalars(obj: dict[str, Any], name: str) -> dict[str, Scalar]:
    value = obj.get(name, {})
    if not isinstance(value, dict) or len(value) > MAX_HEADER_FIELDS:
        raise Rejected("schema", f"field {name!r} must be a map of at most {MAX_HEADER_FIELDS} scalars")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, (int, float, str, bool)):
            raise Rejected("schema", f"field {name!r} must map names to scalars")
        if isinstance(item, float) and not math.isfinite(item):
            raise Rejected("non_finite", f"{name}[{key!r}] is not finite")
        if len(key) > MAX_STRING or (isinstance(item, str) and len(item) > MAX_STRING):
            raise Rejected("schema", f"{name}[{key[:32]!r}] is longer than {MAX_STRING} characters")
    return value


def _string(obj: dict[str, Any], name: str) -> str:
    value = typed_field(obj, name, str)
    if len(value) > MAX_STRING:
        raise Rejected("schema", f"field {name!r} is longer than {MAX_STRING} characters")
    return value


def _attempt(obj: dict[str, Any]) -> int:
    attempt = obj.get("attempt", 1)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise Rejected("schema", f"field 'attempt' must be a positive integer, got {attempt!r}")
    return attempt


def decode_task(data: bytes, max_bytes: int = 65536) -> Task:
    obj = unpack(data, "task", max_bytes)
    return Task(
        round=typed_field(obj, "round", int),
        model_version=typed_field(obj, "model_version", int),
        deadline=float(typed_field(obj, "deadline", (int, float))),
        algorithm=typed_field(obj, "algorithm", str),
        hparams=_scalars(obj, "hparams"),
        broadcast=_scalars(obj, "broadcast"),
        codec=typed_field(obj, "codec", str),
        attempt=_attempt(obj),
        protocol=obj["schema"],
        task=_optional(obj, "task", str, "classification"),
        loss=_optional(obj, "loss", str, "cross_entropy"),
        evaluate=_optional(obj, "evaluate", bool, False),
        train=_optional(obj, "train", bool, True),
    )


def _optional(obj: dict[str, Any], name: str, types: type, default: Any) -> Any:
    """A field newer senders add: absent means the default, present must have the right type."""
    return typed_field(obj, name, types) if name in obj else default


def encode_update(update: Update, key: bytes, protocol: int = SCHEMA_VERSION) -> bytes:
    """The update as it goes on the wire: signed with the device's own key, in the task's protocol."""
    return signing.sign(encode("update", update, protocol), key)


def encode_refusal(refusal: Refusal, key: bytes, protocol: int = SCHEMA_VERSION) -> bytes:
    return signing.sign(encode("refusal", refusal, protocol), key)


def encode_report(report: EvalReport, key: bytes, protocol: int = SCHEMA_VERSION) -> bytes:
    return signing.sign(encode("report", report, protocol), key)


Answer = Update | Refusal | EvalReport


def decode_answer(data: bytes, max_bytes: int, key: bytes | None, sender: str = "sender") -> Answer:
    """What a device published on its update topic: size cap, then the signature (with `sender`'s
    key), and only then the header, which is an update, a refusal or an evaluation report."""
    if len(data) > max_bytes:
        raise Rejected("oversized", f"update of {len(data)} bytes exceeds the cap of {max_bytes}")
    obj = unpack(signing.verify(data, key, sender), "update", max_bytes, also=("refusal", "report"))
    if obj["kind"] == "refusal":
        return Refusal(device=_device(obj), round=typed_field(obj, "round", int), attempt=_attempt(obj),
                       reason=_string(obj, "reason"), detail=_string(obj, "detail"),
                       federation=typed_field(obj, "federation", str))
    if obj["kind"] == "report":
        return _report(obj)
    return _update(obj)


def _report(obj: dict[str, Any]) -> EvalReport:
    report = EvalReport(device=_device(obj), round=typed_field(obj, "round", int), attempt=_attempt(obj),
                        model_version=typed_field(obj, "model_version", int), metric=_string(obj, "metric"),
                        score=float(typed_field(obj, "score", (int, float))),
                        loss=float(typed_field(obj, "loss", (int, float))),
                        count=typed_field(obj, "count", int), federation=typed_field(obj, "federation", str))
    if report.count <= 0:
        raise Rejected("schema", f"an evaluation report needs a positive sample count, got {report.count}")
    if not (math.isfinite(report.score) and math.isfinite(report.loss)):
        raise Rejected("non_finite", f"evaluation report score {report.score} / loss {report.loss} is not finite")
    return report


def decode_update(data: bytes, max_bytes: int, key: bytes | None, sender: str = "sender") -> Update:
    """An update only (a refusal is rejected): see `decode_answer`."""
    answer = decode_answer(data, max_bytes, key, sender)
    if not isinstance(answer, Update):
        kind = "refusal" if isinstance(answer, Refusal) else "report"
        raise Rejected("schema", f"expected an update message, got kind {kind!r}")
    return answer


def _device(obj: dict[str, Any]) -> str:
    device = typed_field(obj, "device", str)
    try:
        check_name("device", device)
    except ValueError as exc:
        raise Rejected("schema", str(exc)) from None
    return device


def _update(obj: dict[str, Any]) -> Update:
    device = _device(obj)
    update = Update(
        device=device,
        round=typed_field(obj, "round", int),
        model_version=typed_field(obj, "model_version", int),
        num_samples=typed_field(obj, "num_samples", int),
        metrics=_scalars(obj, "metrics"),
        body=typed_field(obj, "body", bytes),
        codec=typed_field(obj, "codec", str),
        specs=typed_field(obj, "specs", list),
        federation=typed_field(obj, "federation", str),
        attempt=_attempt(obj),
    )
    if update.num_samples <= 0:
        raise Rejected("schema", f"num_samples must be positive, got {update.num_samples}")
    return update


def decode_receipt(data: bytes, max_bytes: int = 4096) -> Receipt:
    obj = unpack(data, "receipt", max_bytes)
    return Receipt(round=typed_field(obj, "round", int), attempt=_attempt(obj),
                   accepted=typed_field(obj, "accepted", bool),
                   reason=_string(obj, "reason"), detail=typed_field(obj, "detail", str),
                   verdict=_optional(obj, "verdict", str, "")[:MAX_STRING],
                   scale=_scale(_optional(obj, "scale", (int, float), 1.0)), protocol=obj["schema"])



def _scale(value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise Rejected("schema", f"receipt scale must be in [0, 1], got {value!r}")
    return float(value)


def decode_model(data: bytes, max_bytes: int) -> ModelRelease:
    """A model manifest; `max_bytes` caps the declared model size, not just this message."""
    obj = unpack(data, "model", 1024 * 1024)
    release = ModelRelease(
        version=typed_field(obj, "version", int),
        arch=typed_field(obj, "arch", str),
        codec=typed_field(obj, "codec", str),
        specs=typed_field(obj, "specs", list),
        size=typed_field(obj, "size", int),
        sha256=typed_field(obj, "sha256", str),
        chunks=typed_field(obj, "chunks", int),
        chunk_bytes=typed_field(obj, "chunk_bytes", int),
        fingerprint=_optional(obj, "fingerprint", str, ""),
        chain=_chain(obj.get("chain", [])),
    )
    if not 0 <= release.size <= max_bytes:
        raise Rejected("oversized", f"model declares {release.size} bytes, the cap is {max_bytes}")
    if release.chunk_bytes < 1 or release.chunks != max(1, -(-release.size // release.chunk_bytes)):
        raise Rejected("schema", f"model declares {release.chunks} chunks of {release.chunk_bytes} bytes "
                                 f"for {release.size} bytes")
    _sha256(release.sha256, "model sha256")
    return release


def _sha256(value: str, what: str) -> str:
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise Rejected("schema", f"{what} must be 64 lower-case hex digits")
    return value


def _chain(value: object) -> list:
    if not isinstance(value, list) or len(value) > MAX_CHAIN:
        raise Rejected("schema", f"model chain must be a list of at most {MAX_CHAIN} [version, sha256 prefix] pairs")
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and item[0] >= 1
                and isinstance(item[1], str) and len(item[1]) == 16
                and all(c in "0123456789abcdef" for c in item[1])):
            raise Rejected("schema", "each model chain entry must be [version >= 1, 16 lower-case hex digits of a sha256]")
    return value


def decode_delta(data: bytes, max_bytes: int) -> ModelDelta:
    """One downlink delta (see `delta_downlink`); its tensors are checked when they are decoded."""
    obj = unpack(data, "delta", max_bytes)
    delta = ModelDelta(version=typed_field(obj, "version", int), base_sha256=typed_field(obj, "base_sha256", str),
                       sha256=typed_field(obj, "sha256", str), codec=typed_field(obj, "codec", str),
                       specs=typed_field(obj, "specs", list), body=typed_field(obj, "body", bytes),
                       state_specs=typed_field(obj, "state_specs", list), state=typed_field(obj, "state", bytes))
    if delta.version < 1:
        raise Rejected("schema", f"delta version must be >= 1, got {delta.version}")
    _sha256(delta.base_sha256, "delta base_sha256")
    _sha256(delta.sha256, "delta sha256")
    return delta


def decode_status(data: bytes, max_bytes: int = 65536) -> Status:
    obj = unpack(data, "status", max_bytes)
    state = typed_field(obj, "state", str)
    if state not in ("online", "offline"):
        raise Rejected("schema", f"status state must be online or offline, got {state!r}")
    return Status(device=typed_field(obj, "device", str), state=state, profile=_scalars(obj, "profile"))
