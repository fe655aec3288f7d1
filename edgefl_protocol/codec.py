"""How tensors travel: named float arrays <-> msgpack-ready bytes.

The skeleton ships one lossless codec, `float32`. Every decoder checks the
declared shapes against what the receiver expects and against a size cap
*before* allocating, and refuses non-finite values, raising `Rejected`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgpack
import numpy as np

from .errors import Rejected

CODECS = ("float32",)
TensorSpecs = Mapping[str, tuple[int, ...]]


def encode(tensors: Mapping[str, np.ndarray], codec: str = "float32") -> bytes:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    items = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype="<f4")
        items.append([name, list(array.shape), array.tobytes()])
    return msgpack.packb({"codec": codec, "tensors": items}, use_bin_type=True)


def specs_of(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(array.shape) for name, array in tensors.items()}


def decode(data: bytes, expected: TensorSpecs | None, max_values: int) -> dict[str, np.ndarray]:
    """Decode and validate. `expected=None` accepts any shapes (used for the model download)."""
    try:
        obj = msgpack.unpackb(data, raw=False, max_bin_len=4 * max_values + 64, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for junk
        raise Rejected("malformed", f"tensor body is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or obj.get("codec") not in CODECS or not isinstance(obj.get("tensors"), list):
        raise Rejected("malformed", "tensor body must be a map with a known 'codec' and a 'tensors' list")
    items = obj["tensors"]
    if expected is not None and len(items) != len(expected):
        raise Rejected("shape", f"expected {len(expected)} tensors, got {len(items)}")
    total = 0
    out: dict[str, np.ndarray] = {}
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[1], list) and all(isinstance(d, int) and 0 <= d < 2**31 for d in item[1])
                and isinstance(item[2], bytes)):
            raise Rejected("malformed", "each tensor must be [name, shape, bytes]")
        name, shape, raw = item[0], tuple(item[1]), item[2]
        count = math.prod(shape)
        total += count
        if total > max_values:
            raise Rejected("oversized", f"tensors declare more than the cap of {max_values} values")
        if expected is not None and expected.get(name) != shape:
            raise Rejected("shape", f"tensor {name!r} has shape {shape}, expected {expected.get(name)}")
        if len(raw) != 4 * count:
            raise Rejected("malformed", f"tensor {name!r} declares {count} values but carries {len(raw)} bytes")
        if name in out:
            raise Rejected("malformed", f"tensor {name!r} appears twice")
        array = np.frombuffer(raw, dtype="<f4").reshape(shape)
        if not np.isfinite(array).all():
            raise Rejected("non_finite", f"tensor {name!r} contains NaN or infinity")
        out[name] = array
    return out
