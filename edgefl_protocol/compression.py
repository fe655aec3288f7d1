"""Lossless compression of a tensor body, with a hard cap on what decompression may produce.

`zlib` (standard library) is the default. `zstd` uses the optional `zstandard`
package; bench/codec.py measures both, and the project's default codec uses
whichever wins (see the README).
"""

from __future__ import annotations

import zlib

from .errors import Rejected

METHODS = ("zlib", "zstd")
ZLIB_LEVEL = 6
ZSTD_LEVEL = 3


def check_available(method: str) -> None:
    if method == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise ValueError("codec uses zstd but the 'zstandard' package is not installed: "
                             "pip install 'edgefl[zstd]' or choose +zlib") from None
    elif method not in METHODS:
        raise ValueError(f"unknown compressor {method!r}; choose one of {', '.join(METHODS)}")


def compress(data: bytes, method: str) -> bytes:
    if not method:
        return data
    if method == "zlib":
        return zlib.compress(data, ZLIB_LEVEL)
    import zstandard
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def decompress(data: bytes, method: str, limit: int) -> bytes:
    """Inflate at most `limit` bytes; more than that, a truncated stream or trailing junk is Rejected."""
    if not method:
        if len(data) > limit:
            raise Rejected("oversized", f"tensor body of {len(data)} bytes exceeds the {limit} its specs allow")
        return data
    if method == "zlib":
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
    try:
        import zstandard
    except ImportError:
        raise Rejected("codec", "zstd body but the 'zstandard' package is not installed here") from None
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False)
        out = reader.read(limit + 1)
        if reader.read(1):
            raise Rejected("malformed", "tensor body has bytes after its zstd frame")
    except zstandard.ZstdError as exc:
        raise Rejected("malformed", f"tensor body is not valid zstd ({exc})") from None
    if len(out) > limit:
        raise Rejected("oversized", f"tensor body inflates past the {limit} bytes its specs allow")
    return out
