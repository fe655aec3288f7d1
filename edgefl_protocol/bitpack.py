"""Bit-level packing for the update codec: 4-bit values two per byte, and
non-negative integers as LEB128 varints. Decoding treats the bytes as hostile
and raises `Rejected` on anything malformed, never another exception."""

from __future__ import annotations

import numpy as np

from .errors import Rejected


def pack4(q: np.ndarray) -> np.ndarray:
    """Values 0..15, two per byte (low nibble first)."""
    if q.size % 2:
        q = np.append(q, np.uint8(0))
    return (q[0::2] | (q[1::2] << 4)).astype(np.uint8)


def unpack4(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:n]


def varint_encode(values: np.ndarray) -> bytes:
    """Non-negative integers < 2^32 as LEB128 (7 bits per byte, high bit = more follows)."""
    v = np.asarray(values, dtype=np.uint64)
    if v.size and int(v.max()) >= 1 << 32:
        raise ValueError("varint values must be < 2^32")
    nbytes = np.ones(v.size, dtype=np.int64)
    for shift in (7, 14, 21, 28):
        nbytes += v >= (1 << shift)
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for j in range(5):
        has = nbytes > j
        if not has.any():
            break
        byte = (v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (nbytes[has] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + j] = (byte | more).astype(np.uint8)
    return out.tobytes()


def varint_decode(data: bytes, count: int) -> np.ndarray:
    """Exactly `count` LEB128 values of at most 5 bytes each, filling `data` exactly; else Rejected."""
    b = np.frombuffer(data, dtype=np.uint8)
    if count and b.size == count and b.max() < 0x80:  # every value fits one byte: the common case
        return b.astype(np.int64)
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count or (count and ends[-1] != b.size - 1) or (not count and b.size):
        raise Rejected("malformed", f"index block does not hold exactly {count} varints")
    if not count:
        return np.zeros(0, dtype=np.int64)
    group_start = np.zeros(b.size, dtype=np.int64)
    group_start[ends[:-1] + 1] = ends[:-1] + 1
    group_start = np.maximum.accumulate(group_start)
    position = np.arange(b.size, dtype=np.int64) - group_start
    if position.max() >= 5:
        raise Rejected("malformed", "a varint index is longer than 5 bytes")
    parts = (b & 0x7F).astype(np.int64) << (7 * position)
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    values = np.add.reduceat(parts, starts)
    if values.max() >= 1 << 32:
        raise Rejected("malformed", "a varint index is 2^32 or more")
    return values
