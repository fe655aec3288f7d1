"""Lossless compression of a tensor body, with a hard cap on what decompression may produce.

zlib (standard library) only. zstandard was measured against it on the same
bodies (bench/codec.py, bench/results/codec.md): it was not measurably smaller
(quantized values and delta-coded indices leave little for either), so it is
not a dependency.
"""

from __future__ import annotations

import zlib

from .errors import Rejected

METHODS = ("zlib",)
ZLIB_LEVEL = 6


def check_available(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown compressor {method!r}; choose one of {', '.join(METHODS)}")


def compress(data: bytes, method: str) -> bytes:
    return zlib.compress(data, ZLIB_LEVEL) if method == "zlib" else data


def decompress(data: bytes, method: str, limit: int) -> bytes:
    """Inflate at most `limit` bytes; more than that, a truncated stream or trailing junk is Rejected."""
    if not method:
        if len(data) > limit:
            raise Rejected("oversized", f"tensor body of {len(data)} bytes exceeds the {limit} its specs allow")
        return data
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, limit)
    except zlib.error as exc:
        raise Rejected("malformed", f"tensor body is not valid zlib ({exc})") from None
    if inflater.unconsumed_tail:
        raise Rejected("oversized", f"tensor body inflates past the {limit} bytes its specs allow")
    if not inflater.eof or inflater.unused_data:
        raise Rejected("malformed", "tensor body is a truncated zlib stream or has trailing bytes")
    return out
