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

from edgefl_protocol.persist import atomic_write, pack, unpack

log = logging.getLogger("edge_agent.state")
STATE_FILE = "state.msgpack"


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
            loaded = unpack(self.path.read_bytes())
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
        atomic_write(self.path, pack(self.data))
