"""Crash-safe files: atomic replace with fsync, and msgpack that carries numpy arrays.

Every state, credential and config file the agent and the coordinator write
goes through `atomic_write` (device state, checkpoints, the agents' configs,
the broker's password, ACL and config files, key files, unit files): after a
crash a file is either the old version or the new one, never a torn mix.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import numpy as np


def atomic_write(path: Path | str, data: bytes | str, mode: int = 0o600,
                 owner: tuple[int, int] | None = None) -> None:
    """Replace `path` by `data` so that after a crash it is the old file or the new one, never a
    torn mix: a temp file beside it, unique (two writers at once do not share one), given `mode`
    (whatever the umask) and `owner` (uid, gid) before it holds anything, written, fsynced, renamed
    over `path`, and the directory fsynced. A failed write leaves no temp file behind."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            if owner is not None:
                os.fchown(handle.fileno(), *owner)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def file_sha256(path: Path | str) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


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
