"""Crash-safe files: atomic replace with fsync, and msgpack that carries numpy arrays.

Used for the agent's device state and the coordinator's checkpoints: after a
crash a file is either the old version or the new one, never a torn mix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import numpy as np


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return {"__ndarray__": True, "dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot persist {type(obj).__name__}")


def _unpack_hook(obj: dict) -> Any:
    if obj.get("__ndarray__"):
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    return obj


def pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_pack_default, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Only for our own files (trusted); never for network input."""
    return msgpack.unpackb(data, raw=False, object_hook=_unpack_hook, strict_map_key=False)
