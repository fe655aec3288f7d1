"""Device state on disk: one msgpack file, written atomically.

SD cards wear and power fails mid-write, so state is written rarely (once per
round) and always as write-temp, fsync, rename, fsync-directory: after a crash
the file is either the old state or the new one, never a torn mix.

Values may be scalars, strings, lists, dicts and numpy arrays (algorithm
state such as g_fin or a dual variable, the error-feedback residual).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

log = logging.getLogger("edge_agent.state")
STATE_FILE = "state.msgpack"


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return {"__ndarray__": True, "dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in device state")


def _unpack_hook(obj: dict) -> Any:
    if obj.get("__ndarray__"):
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    return obj


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


class DeviceState:
    """A dict persisted in `<state_dir>/state.msgpack`. Call `save()` at safe points."""

    def __init__(self, state_dir: Path | str) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE
        self.data: dict[str, Any] = self._load()

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            loaded = msgpack.unpackb(self.path.read_bytes(), raw=False, object_hook=_unpack_hook,
                                     strict_map_key=False)
        except Exception as exc:  # a corrupt file must not stop the device: start fresh, keep the evidence
            broken = self.path.with_suffix(".corrupt")
            os.replace(self.path, broken)
            log.error("device state %s was unreadable (%s); moved to %s and starting fresh", self.path, exc, broken)
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def section(self, name: str) -> dict[str, Any]:
        """A named sub-dict (e.g. one per algorithm), created on first use."""
        return self.data.setdefault(name, {})

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, msgpack.packb(self.data, default=_pack_default, use_bin_type=True))
