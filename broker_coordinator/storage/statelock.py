"""One coordinator per state directory: `run` holds an exclusive lock on
`<state_dir>/coordinator.lock` while it serves rounds, so that a second
coordinator, or a `rollback` behind its back, is refused with a clear line."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class StateLocked(Exception):
    """Another process holds the state directory; the message says which and what to do."""


class StateLock:
    def __init__(self, state_dir: Path | str) -> None:
        self.path = Path(state_dir) / "coordinator.lock"
        self.fd: int | None = None

    def acquire(self, doing: str) -> "StateLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StateLocked(f"cannot {doing}: a coordinator (pid {holder}) is using {self.path.parent}; stop it "
                              "first ('sudo systemctl stop broker-coordinator')") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> "StateLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
