"""Every top-k tensor of an update decoded at once: one pass of numpy over the whole update
instead of about twenty small calls per tensor.

A model's small tensors (biases of a few values) cost as much to decode one by one as its large
ones: numpy's per-call overhead, not the data, set the coordinator's intake at about 1 ms per
update of the 80k CNN, 8 tensors (bench/runtime.py), the largest share of its CPU per update.
Here the per-tensor work is plain Python checks of lengths and types; the arithmetic runs once
over the concatenated index blocks, packed values, minima and steps. The result is bit for bit
what decoding each tensor alone gives (tests/test_codec.py), and every malformed tensor is still
named in its `Rejected`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from .bitpack import unpack4, varint_decode
from .errors import Rejected


class SparseEntry:
    """One tensor's top-k entry after its structure was checked: where it goes and its raw parts."""

    __slots__ = ("name", "size", "kept", "index", "minima", "steps", "packed")

    def __init__(self, name: str, size: int, kept: int, entry: object, values: str, bits: int,
                 chunk: int | None) -> None:
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and entry[0] == kept
                and isinstance(entry[1], bytes)):
            raise Rejected("malformed", f"tensor {name!r}: a top-k entry must be [{kept}, index bytes, values]")
        if len(entry[1]) > 5 * kept:
            raise Rejected("malformed", f"tensor {name!r}: index block too long")
        self.name, self.size, self.kept, self.index = name, size, kept, entry[1]
        body = entry[2]
        if values in ("float32", "float16"):
            width = bits // 8
            if not isinstance(body, bytes) or len(body) != width * kept:
                raise Rejected("malformed", f"tensor {name!r}: expected {width * kept} bytes of {values}")
            self.minima = self.steps = b""
            self.packed = body
            return
        step = chunk or max(kept, 1)
        chunks = -(-kept // step)
        packed_len = kept if bits == 8 else (kept + 1) // 2
        if not (isinstance(body, list) and len(body) == 3 and all(isinstance(e, bytes) for e in body)
                and len(body[0]) == 4 * chunks and len(body[1]) == 4 * chunks and len(body[2]) == packed_len):
            raise Rejected("malformed", f"tensor {name!r}: expected [{4 * chunks} bytes of minima, "
                                        f"{4 * chunks} bytes of steps, {packed_len} bytes of {values}]")
        if bits == 4 and kept % 2 and body[2][-1] >> 4:
            raise Rejected("malformed", f"tensor {name!r}: padding nibble is not zero")
        self.minima, self.steps, self.packed = body[0], body[1], body[2]


def _starts(lengths: Sequence[int]) -> np.ndarray:
    """Where each segment begins in their concatenation."""
    return np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1])).astype(np.int64)


class Layout:
    """Where every kept value of an update goes, from its tensors' sizes and kept counts alone.
    They are the same for every update of a model in a codec, so this is built once (`layout`):
    the per-update work is then a dozen numpy calls, whatever the number of tensors."""

    def __init__(self, sizes: tuple[int, ...], kept: tuple[int, ...], bits: int, chunk: int | None) -> None:
        self.total, self.count = sum(sizes), sum(kept)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.kept_starts = _starts(kept)
        self.kept = np.asarray(kept, dtype=np.int64)
        self.last = np.maximum(self.kept_starts + self.kept - 1, 0)  # each tensor's last kept value
        self.nonempty = self.kept > 0
        value_start = np.repeat(self.kept_starts, kept)
        self.positions = _starts(sizes)  # each tensor's first value in the model's flat vector
        self.offset = np.repeat(self.positions, kept)
        position = np.arange(self.count, dtype=np.int64) - value_start  # within its tensor
        # each tensor's nibbles start on a byte: skip the padding nibble an odd count leaves
        self.nibble = (np.arange(self.count, dtype=np.int64)
                       + np.repeat(_starts([(k + 1) // 2 * 2 for k in kept]) - self.kept_starts, kept))
        widths = [chunk or max(k, 1) for k in kept]  # no chunk size: one (min, step) pair per tensor
        first_chunk = _starts([-(-k // w) for k, w in zip(kept, widths)])
        self.chunk = np.repeat(first_chunk, kept) + position // np.repeat(np.asarray(widths, dtype=np.int64), kept)
        self.bits = bits


@functools.lru_cache(maxsize=16)
def layout(sizes: tuple[int, ...], kept: tuple[int, ...], bits: int, chunk: int | None) -> Layout:
    return Layout(sizes, kept, bits, chunk)


def _positions(entries: Sequence[SparseEntry], where: Layout) -> np.ndarray:
    """Each kept value's position in the model's flat vector."""
    gaps = None
    if all(len(e.index) == e.kept for e in entries):  # every gap fits one byte: the common case
        gaps = np.frombuffer(b"".join(e.index for e in entries), dtype=np.uint8)
        if gaps.size and gaps.max() >= 0x80:
            gaps = None
    if gaps is None:  # per tensor, so that a malformed block is named
        gaps = np.concatenate([varint_decode(e.index, e.kept) for e in entries])
    running = np.cumsum(gaps, dtype=np.int64)
    running += np.arange(1, where.count + 1)  # each gap + 1
    before = np.concatenate(([0], running))[where.kept_starts]  # the running sum where each tensor began
    local = running - np.repeat(before, where.kept) - 1
    outside = where.nonempty & (local[where.last] >= where.sizes) if where.count else where.nonempty
    if outside.any():
        t = int(np.flatnonzero(outside)[0])
        e = entries[t]
        raise Rejected("malformed", f"tensor {e.name!r}: index {int(local[where.last[t]])} "
                                    f"is outside {e.size} values")
    return local + where.offset


def _values(entries: Sequence[SparseEntry], values: str, where: Layout) -> np.ndarray:
    """Every kept value, in the order of the entries, as float32 (the same arithmetic as one by one)."""
    if values in ("float32", "float16"):
        raw = np.frombuffer(b"".join(e.packed for e in entries), dtype="<f4" if where.bits == 32 else "<f2")
        return raw.astype(np.float32)
    packed = np.frombuffer(b"".join(e.packed for e in entries), dtype=np.uint8)
    q = packed if where.bits == 8 else unpack4(packed, 2 * packed.size)[where.nibble]
    minima = np.frombuffer(b"".join(e.minima for e in entries), dtype="<f4")
    steps = np.frombuffer(b"".join(e.steps for e in entries), dtype="<f4")
    if not (np.isfinite(minima).all() and np.isfinite(steps).all() and (steps >= 0).all()):
        for e in entries:
            lo, st = np.frombuffer(e.minima, dtype="<f4"), np.frombuffer(e.steps, dtype="<f4")
            if not (np.isfinite(lo).all() and np.isfinite(st).all() and (st >= 0).all()):
                raise Rejected("non_finite", f"tensor {e.name!r}: quantization minima and steps must be "
                                             "finite, steps >= 0")
    return q.astype(np.float32) * steps[where.chunk] + minima[where.chunk]


def decode_sparse(entries: Sequence[SparseEntry], values: str, bits: int,
                  chunk: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries' tensors end to end, dense (float32), with the positions of their kept values in
    that vector (increasing) and the values. Raises only `Rejected`."""
    if not entries:
        return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    where = layout(tuple(e.size for e in entries), tuple(e.kept for e in entries), bits, chunk)
    positions = _positions(entries, where)
    decoded = _values(entries, values, where)
    if not np.isfinite(decoded).all():
        for e, start in zip(entries, where.kept_starts):
            if not np.isfinite(decoded[start:start + e.kept]).all():
                raise Rejected("non_finite", f"tensor {e.name!r} contains NaN or infinity")
    flat = np.zeros(where.total, dtype=np.float32)
    flat[positions] = decoded
    return flat, positions, decoded
