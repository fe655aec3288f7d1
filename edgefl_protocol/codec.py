"""How tensors travel: named float arrays <-> compact bytes, and back without trusting the bytes.

A codec is named by a '+'-joined pipeline, applied left to right on the sender:

    [topk<F>+] <values> [+zlib]

    topk<F>   keep the fraction F of each tensor's entries with the largest
              magnitude (e.g. topk0.05); the indices travel sorted and
              delta-coded as LEB128 varints. What is not sent is the
              error-feedback residual: `encode` returns it, the device keeps it
              (persisted with its state) and adds it to the next delta.
    values    float32 | float16 | q8 | q4, with an optional chunk size: q4c64
              is 4-bit stochastic quantization with one (min, step) pair per
              64 values; q8 without 'c' uses one pair per tensor. 4-bit values
              are packed two per byte.
    zlib      lossless compression of the whole tensor body (see compression.py
              for why not zstd).

Examples: "float32", "float16+zlib", "q8c256", "topk0.05+q4c64+zlib".

Stochastic quantization of x in a chunk [lo, hi] with L = 2^B - 1 levels and
step s = (hi - lo) / L sends q = floor((x - lo) / s + u), u ~ U[0, 1); the
receiver computes lo + q s. It is unbiased, and |x_hat - x| < s.

Algorithm tensors riding along with the delta ("extra.<name>", e.g. FedSMOO's
perturbation dual) go through the same lossy stages but without error
feedback: they are states sent afresh every round, not increments the server
adds up, so nothing is owed to the next round (bench/results/field.md measures
what this costs FedSMOO). Tensors named "extra.exact.<name>" always travel as
float32, for state an algorithm cannot afford to round. The codec knows
nothing else about names.

`decode` treats every byte as hostile: the tensor specs are checked against
the receiver's expectation and a cap on the number of values *before*
anything is decompressed or allocated, every length is checked exactly, and
any problem raises `Rejected` (never another exception).
"""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from . import compression
from .bitpack import pack4, unpack4, varint_encode
from .errors import Rejected
from .sparse_decode import SparseEntry, decode_sparse
from .sparse_delta import Decoded, SparseDelta

EXACT_PREFIX = "extra.exact."  # tensors never sent lossy
STATE_PREFIX = "extra."  # algorithm state: lossy stages, no error feedback
# The default uplink codec: the fewest bytes within 0.5 points of float32 accuracy in bench/codec.py
# (bench/results/codec.md): about 30x fewer bytes than float32.
DEFAULT = "topk0.1+q4c64+zlib"
# What `codec = "auto"` (the coordinator's default) names: DEFAULT for a model of at least
# TOPK_MIN_VALUES parameters, DENSE below. On small models top-k saves little (about 280 bytes an
# update on the 610-parameter logistic regression, 2.2 KB on the 4,810-parameter digits MLP, against
# 37 KB on the 80k CNN) and costs the default algorithm accuracy: dense, `dynsam` gains 1.3 points
# on Synthetic(1,1) and on digits (docs/RESEARCH.md, "Uplink codec by model size").
AUTO = "auto"
DENSE = "q4c64+zlib"
TOPK_MIN_VALUES = 10_000
MAX_TENSORS = 4096
MAX_NDIM = 8
VALUE_KINDS = {"float32": 32, "float16": 16, "q8": 8, "q4": 4}
TensorSpecs = Mapping[str, tuple[int, ...]]
_VALUES = re.compile(r"^(float32|float16|q8|q4)(?:c([1-9][0-9]{0,4}))?$")
_TOPK = re.compile(r"^topk(0?\.[0-9]+|1(?:\.0*)?)$")


@dataclass(frozen=True)
class CodecSpec:
    values: str = "float32"
    chunk: int = 0  # values per (min, step) pair for q8/q4; 0 = one pair per tensor
    topk: float = 0.0  # fraction kept per tensor; 0 = dense
    compressor: str = ""  # "" or "zlib"

    @property
    def bits(self) -> int:
        return VALUE_KINDS[self.values]

    @property
    def quantized(self) -> bool:
        return self.values in ("q8", "q4")

    @property
    def lossless(self) -> bool:
        return self.values == "float32" and not self.topk

    @property
    def name(self) -> str:
        parts = [f"topk{self.topk:g}"] if self.topk else []
        parts.append(self.values + (f"c{self.chunk}" if self.chunk else ""))
        if self.compressor:
            parts.append(self.compressor)
        return "+".join(parts)


def parse(name: str) -> CodecSpec:
    """A codec name -> its spec; ValueError names what is wrong (use it to validate config)."""
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ValueError(f"codec must be a non-empty name of at most 64 characters, got {name!r:.80}")
    if name == AUTO:
        raise ValueError(f"codec {AUTO!r} names a codec only once the model is known (codec.resolve)")
    return _parse(name)


def check(name: str) -> str:
    """A configured codec: a codec name or AUTO (returned as its canonical name). ValueError if neither."""
    return AUTO if name == AUTO else parse(name).name


def resolve(name: str, num_values: int) -> str:
    """The codec a model of `num_values` parameters is sent in: `name` itself unless it is AUTO."""
    if name != AUTO:
        return parse(name).name
    return DEFAULT if num_values >= TOPK_MIN_VALUES else DENSE


@functools.lru_cache(maxsize=64)
def _parse(name: str) -> CodecSpec:
    parts = name.split("+")
    topk, compressor = 0.0, ""
    if parts and (m := _TOPK.match(parts[0])):
        topk = float(m.group(1))
        if not 0 < topk <= 1:
            raise ValueError(f"codec {name!r}: topk fraction must be in (0, 1]")
        parts = parts[1:]
    if parts and parts[-1] in compression.METHODS:
        compressor = parts.pop()
    if len(parts) != 1 or not (m := _VALUES.match(parts[0])):
        raise ValueError(f"unknown codec {name!r}: write [topk<F>+]<float32|float16|q8|q4>[c<N>][+zlib], "
                         "e.g. topk0.05+q4c64+zlib")
    values, chunk = m.group(1), int(m.group(2) or 0)
    if chunk and values not in ("q8", "q4"):
        raise ValueError(f"codec {name!r}: a chunk size applies only to q8 and q4")
    return CodecSpec(values, chunk, topk, compressor)


def specs_of(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(array.shape) for name, array in tensors.items()}


def kept(spec: CodecSpec, size: int) -> int:
    """How many entries top-k keeps of a tensor of `size` values (the receiver checks this exactly)."""
    if not spec.topk or size == 0:
        return size
    return min(size, max(1, math.ceil(spec.topk * size)))


# --- encoding (the sender's side; its inputs are its own) ----------------------------

@dataclass
class Encoded:
    codec: str
    specs: list[list]  # [[name, [dims...]], ...] in body order
    body: bytes
    residual: dict[str, np.ndarray] | None  # error feedback for top-k codecs, else None


def encode(tensors: Mapping[str, np.ndarray], codec: str = "float32",
           residual: Mapping[str, np.ndarray] | None = None, rng: np.random.Generator | None = None) -> Encoded:
    """Encode named float tensors. For top-k codecs `residual` (what earlier rounds did not
    send) is added first and the new residual is returned in `Encoded.residual`."""
    spec = parse(codec)
    rng = rng or np.random.default_rng()
    entries, specs = [], []
    new_residual: dict[str, np.ndarray] | None = {} if spec.topk else None
    for name, array in tensors.items():
        array = np.asarray(array, dtype=np.float32)
        if not np.isfinite(array).all():
            raise ValueError(f"tensor {name!r} contains NaN or infinity; refusing to send it")
        specs.append([name, list(array.shape)])
        flat = array.ravel()
        if name.startswith(EXACT_PREFIX) or spec.lossless:
            entries.append(np.ascontiguousarray(flat, dtype="<f4").tobytes())
            continue
        if spec.topk:
            is_state = name.startswith(STATE_PREFIX)
            previous = None if residual is None or is_state else residual.get(name)
            if previous is not None and previous.shape == array.shape:
                flat = flat + np.asarray(previous, dtype=np.float32).ravel()
            k = kept(spec, flat.size)
            index = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]) if k < flat.size \
                else np.arange(flat.size)
            values_entry, sent = _encode_values(flat[index], spec, rng)
            gaps = np.diff(index, prepend=-1) - 1
            entries.append([k, varint_encode(gaps), values_entry])
            if not is_state:
                rest = flat.copy()
                rest[index] -= sent
                new_residual[name] = rest.reshape(array.shape)
        else:
            entries.append(_encode_values(flat, spec, rng)[0])
    body = msgpack.packb(entries, use_bin_type=True)
    return Encoded(spec.name, specs, compression.compress(body, spec.compressor), new_residual)


def _encode_values(flat: np.ndarray, spec: CodecSpec, rng: np.random.Generator):
    """One flat vector -> (entry, what the receiver will reconstruct)."""
    if spec.values == "float32":
        return flat.astype("<f4").tobytes(), flat
    if spec.values == "float16":
        half = np.clip(flat, -65504.0, 65504.0).astype("<f2")
        return half.tobytes(), half.astype(np.float32)
    levels = (1 << spec.bits) - 1
    n = flat.size
    chunk = spec.chunk or max(n, 1)
    chunks = -(-n // chunk)
    if n == 0:
        return [b"", b"", b""], flat
    padded = np.pad(flat, (0, chunks * chunk - n), mode="edge").reshape(chunks, chunk)
    lo = padded.min(axis=1)
    step = ((padded.max(axis=1) - lo) / levels).astype(np.float32)
    scaled = (padded - lo[:, None]) / np.where(step > 0, step, 1)[:, None]
    q = np.floor(scaled + rng.random(scaled.shape, dtype=np.float32))
    q = np.clip(q, 0, levels).astype(np.uint8).ravel()[:n]
    sent = (lo.repeat(chunk)[:n] + q * step.repeat(chunk)[:n]).astype(np.float32)
    packed = q if spec.bits == 8 else pack4(q)
    return [lo.astype("<f4").tobytes(), step.astype("<f4").tobytes(), packed.tobytes()], sent


# --- decoding (the receiver's side; every byte is hostile) ---------------------------

def check_specs(specs: object, expected: TensorSpecs | None, max_values: int) -> list[tuple[str, tuple[int, ...]]]:
    """Validate declared tensor specs against the cap and the expected shapes, allocating nothing."""
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise Rejected("schema", f"tensor specs must be a list of at most {MAX_TENSORS} [name, shape] pairs")
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    total = 0
    for item in specs:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and len(item[0]) <= 256
                and isinstance(item[1], list) and len(item[1]) <= MAX_NDIM
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in item[1])):
            raise Rejected("schema", "each tensor spec must be [name, [dims...]] with at most 8 non-negative dims")
        name, shape = item[0], tuple(item[1])
        if name in seen:
            raise Rejected("schema", f"tensor {name!r} is declared twice")
        seen.add(name)
        if expected is not None and expected.get(name) != shape:  # a tensor we do not expect is a shape error
            what = f"expected {expected[name]}" if name in expected else "no such tensor is expected"
            raise Rejected("shape", f"tensor {name!r} has shape {shape}, {what}")
        total += math.prod(shape)
        if total > max_values:
            raise Rejected("oversized", f"tensors declare more than the cap of {max_values} values")
        out.append((name, shape))
    if expected is not None and len(out) != len(expected):
        missing = sorted(set(expected) - seen)
        raise Rejected("shape", f"expected {len(expected)} tensors, got {len(out)} (missing {', '.join(missing[:5])})")
    return out


def _values_bytes(spec: CodecSpec, n: int) -> int:
    """Upper bound of one values entry's encoded size (for the decompression limit)."""
    if spec.values in ("float32", "float16"):
        return n * spec.bits // 8
    chunks = -(-n // (spec.chunk or max(n, 1)))
    return 8 * chunks + (n if spec.bits == 8 else (n + 1) // 2)


@functools.lru_cache(maxsize=64)  # every update of a model in a codec declares the same shapes
def body_limit(spec: CodecSpec, shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    """The largest body the declared specs allow: decompression stops there."""
    limit = 16
    for name, shape in shapes:
        n = math.prod(shape)
        if name.startswith(EXACT_PREFIX) or spec.lossless:
            limit += 4 * n + 16
        else:
            k = kept(spec, n)
            limit += _values_bytes(spec, k) + (5 * k + 16 if spec.topk else 0) + 32
    return limit


def decode(codec: object, specs: object, body: object, expected: TensorSpecs | None,
           max_values: int) -> dict[str, np.ndarray]:
    """Decode and validate; `expected=None` accepts any shapes under the cap. Raises only `Rejected`."""
    try:
        spec = parse(codec)  # type: ignore[arg-type]
    except ValueError as exc:
        raise Rejected("codec", str(exc)) from None
    shapes = check_specs(specs, expected, max_values)
    if not isinstance(body, bytes):
        raise Rejected("schema", "tensor body must be bytes")
    limit = body_limit(spec, tuple(shapes))
    raw = compression.decompress(body, spec.compressor, limit)
    try:
        entries = msgpack.unpackb(raw, raw=False, max_bin_len=limit, max_str_len=0, max_map_len=0,
                                  max_array_len=max(len(shapes), 3), max_ext_len=0, use_list=True)
    except Exception as exc:  # msgpack raises many types for junk
        raise Rejected("malformed", f"tensor body is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(entries, list) or len(entries) != len(shapes):
        raise Rejected("malformed", f"tensor body must be a list of {len(shapes)} entries")
    out = Decoded()
    sparse: list[SparseEntry] = []  # decoded together: see sparse_decode.py
    with np.errstate(over="ignore", invalid="ignore"):  # overflow becomes inf, which _finite rejects
        for (name, shape), entry in zip(shapes, entries):
            if spec.topk and not (name.startswith(EXACT_PREFIX) or spec.lossless):
                n = math.prod(shape)
                sparse.append(SparseEntry(name, n, kept(spec, n), entry, spec.values, spec.bits, spec.chunk))
                out[name] = None  # type: ignore[assignment]  # keeps the declared order
            else:
                out[name] = _decode_tensor(name, shape, entry, spec)
        flat, positions, values = decode_sparse(sparse, spec.values, spec.bits, spec.chunk)
    if sparse:
        shape_of = dict(shapes)
        out.sparse = SparseDelta(tuple(e.name for e in sparse), tuple(shape_of[e.name] for e in sparse),
                                 positions, values, flat)
        out.update(out.sparse.tensors())
    return out


def _decode_tensor(name: str, shape: tuple[int, ...], entry: object, spec: CodecSpec) -> np.ndarray:
    n = math.prod(shape)
    if name.startswith(EXACT_PREFIX) or spec.lossless:
        flat = _finite(_decode_values(entry, CodecSpec(), n, name), name)
    else:  # dense (top-k tensors are decoded together, in sparse_decode.py)
        flat = _finite(_decode_values(entry, spec, n, name), name)
    return flat.reshape(shape)


def _finite(values: np.ndarray, name: str) -> np.ndarray:
    if not np.isfinite(values).all():
        raise Rejected("non_finite", f"tensor {name!r} contains NaN or infinity")
    return values


def _decode_values(entry: object, spec: CodecSpec, n: int, name: str) -> np.ndarray:
    if spec.values in ("float32", "float16"):
        width = spec.bits // 8
        if not isinstance(entry, bytes) or len(entry) != width * n:
            raise Rejected("malformed", f"tensor {name!r}: expected {width * n} bytes of {spec.values}")
        return np.frombuffer(entry, dtype="<f4" if width == 4 else "<f2").astype(np.float32)
    chunk = spec.chunk or max(n, 1)
    chunks = -(-n // chunk)
    packed_len = n if spec.bits == 8 else (n + 1) // 2
    if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(e, bytes) for e in entry)
            and len(entry[0]) == 4 * chunks and len(entry[1]) == 4 * chunks and len(entry[2]) == packed_len):
        raise Rejected("malformed", f"tensor {name!r}: expected [{4 * chunks} bytes of minima, "
                                    f"{4 * chunks} bytes of steps, {packed_len} bytes of {spec.values}]")
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    packed = np.frombuffer(entry[2], dtype=np.uint8)
    if spec.bits == 4 and n % 2 and packed[-1] >> 4:
        raise Rejected("malformed", f"tensor {name!r}: padding nibble is not zero")
    q = packed if spec.bits == 8 else unpack4(packed, n)
    if chunks == 1:  # one (min, step) pair: plain floats, fewer array operations
        lo1, step1 = struct.unpack("<ff", entry[0] + entry[1])
        if not (math.isfinite(lo1) and math.isfinite(step1) and step1 >= 0):
            raise Rejected("non_finite", f"tensor {name!r}: quantization minimum and step must be finite, step >= 0")
        return np.float32(lo1) + q.astype(np.float32) * np.float32(step1)
    lo = np.frombuffer(entry[0], dtype="<f4")
    step = np.frombuffer(entry[1], dtype="<f4")
    if not (np.isfinite(lo).all() and np.isfinite(step).all() and (step >= 0).all()):
        raise Rejected("non_finite", f"tensor {name!r}: quantization minima and steps must be finite, steps >= 0")
    grid = np.zeros(chunks * chunk, dtype=np.float32)
    grid[:n] = q
    grid = grid.reshape(chunks, chunk)
    grid *= step[:, None]
    grid += lo[:, None]
    return grid.ravel()[:n]
