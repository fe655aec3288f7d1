"""The device registry: one SQLite file on the coordinator.

A device is `pending` from `devices add` (or `rotate`) until it enrolls, then
`active`, and `revoked` for good after `devices revoke`. The registry keeps
the Mosquitto password hash (never a broker password), the device's signing
key (needed to verify its updates), and the current enrollment token's id and
expiry. It lives in the coordinator's database (`<state_dir>/coordinator.db`)
beside the task index and the current task's round tables
(broker_coordinator/storage/tasks.py, store.py), whose `presence` and
`device_rounds` tables give `devices list` its online, last-seen and
rounds-contributed columns (`activity()`: rounds of the current task). A new
task archives its rounds and checkpoints and never touches this table: the
devices stay enrolled from one task to the next.

Admission: once any device is registered, the registry is authoritative, and
an update from a device that is not `active` is rejected (`unknown_device`,
`revoked`). A federation provisioned by hand, with an empty registry, admits
whoever the broker lets in.

Every method opens its own short connection, so the registry is safe to use
from paho's network thread and the main thread alike. Admission, asked on every
update and for every online device, is the exception: it reads one kept
connection's copy of the devices' states, re-read only when `PRAGMA
data_version` says another connection (the CLI's `devices revoke`, this
registry's own writes, the round store) committed since, so a revocation takes
effect on the next update and an update costs no connect.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PENDING, ACTIVE, REVOKED = "pending", "active", "revoked"

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    name           TEXT PRIMARY KEY,
    federation     TEXT NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('pending', 'active', 'revoked')),
    password_hash  TEXT NOT NULL,          -- Mosquitto $7$ hash of the current broker password
    signing_key    TEXT NOT NULL,          -- hex; HMAC-SHA256 key for this device's updates
    token_id       TEXT,                   -- the outstanding enrollment token (pending only)
    token_expires  REAL,
    created_at     REAL NOT NULL,
    enrolled_at    REAL,
    revoked_at     REAL
);
"""


class RegistryError(Exception):
    """A registry operation that cannot be done; the message says what to do."""


@dataclass
class Device:
    name: str
    federation: str
    state: str
    password_hash: str
    signing_key: str
    token_id: str | None
    token_expires: float | None
    created_at: float
    enrolled_at: float | None
    revoked_at: float | None

    def token_valid(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.state == PENDING and self.token_expires is not None and now < self.token_expires


class Registry:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            with self.connect() as db:
                db.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise RegistryError(f"cannot open the device registry {self.path}: {exc} "
                                "(run as root or as the coordinator's service user)") from None
        if created:
            os.chmod(self.path, 0o600)  # it holds signing keys
            match_owner(self.path)
        self._lock = threading.RLock()  # guards the admission reader, shared by paho's thread and the main one
        self._reader: sqlite3.Connection | None = None
        self._read_version: int | None = None
        self._states: dict[str, tuple[str, float | None]] = {}  # name -> (state, revoked_at)

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A connection in a transaction: committed on success, rolled back on error, then closed."""
        db = sqlite3.connect(self.path, timeout=10)
        db.row_factory = sqlite3.Row
        try:
            with db:
                yield db
        finally:
            db.close()

    # reads --------------------------------------------------------------------------
    def get(self, name: str) -> Device | None:
        with self.connect() as db:
            row = db.execute("SELECT * FROM devices WHERE name = ?", (name,)).fetchone()
        return _device(row) if row else None

    def require(self, name: str) -> Device:
        device = self.get(name)
        if device is None:
            raise RegistryError(f"no device named {name!r}: 'broker-coordinator devices list' shows the known ones")
        return device

    def devices(self, federation: str | None = None) -> list[Device]:
        with self.connect() as db:
            if federation is None:
                rows = db.execute("SELECT * FROM devices ORDER BY name").fetchall()
            else:
                rows = db.execute("SELECT * FROM devices WHERE federation = ? ORDER BY name", (federation,)).fetchall()
        return [_device(r) for r in rows]

    def broker_users(self, federation: str | None = None, now: float | None = None) -> dict[str, str]:
        """user -> password hash for the Mosquitto password file: active devices, and pending ones
        whose token has not expired. Revoked devices and expired tokens are left out."""
        now = time.time() if now is None else now
        return {d.name: d.password_hash for d in self.devices(federation)
                if d.state == ACTIVE or d.token_valid(now)}

    def admission(self, name: str) -> tuple[str, str] | None:
        """None if updates from `name` may be accepted, else (reason, detail) for a rejection."""
        states = self._admission_states()
        if name not in states:
            if not states:
                return None  # registry not in use: a fleet provisioned by hand
            return "unknown_device", f"{name} is not in the device registry"
        state, revoked_at = states[name]
        if state == REVOKED:
            return "revoked", f"{name} was revoked at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(revoked_at or 0))}"
        if state == PENDING:
            return "unknown_device", f"{name} has not enrolled yet"
        return None

    def _admission_states(self) -> dict[str, tuple[str, float | None]]:
        """name -> (state, revoked_at) of every device, from the kept connection: re-read when the
        database changed since the last read (data_version moves on any other connection's commit)."""
        with self._lock:
            try:
                if self._reader is None:
                    self._reader = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
                version = self._reader.execute("PRAGMA data_version").fetchone()[0]
                if version != self._read_version:
                    self._states = {name: (state, revoked_at) for name, state, revoked_at in
                                    self._reader.execute("SELECT name, state, revoked_at FROM devices")}
                    self._read_version = version
            except sqlite3.Error:
                self.close()  # a broken connection is reopened on the next question
                raise
            return self._states

    def data_version(self) -> int:
        """A counter that moves whenever another connection commits to the registry (SQLite's
        PRAGMA data_version): a cheap way to know that a re-read would find something new."""
        with self._lock:
            if self._reader is None:
                self._reader = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
            return int(self._reader.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        """Close the admission reader (the other methods keep no connection open)."""
        with self._lock:
            if self._reader is not None:
                self._reader.close()
            self._reader, self._read_version = None, None

    # writes -------------------------------------------------------------------------
    def add(self, name: str, federation: str, password_hash: str, signing_key: str, token_id: str,
            token_expires: float) -> Device:
        existing = self.get(name)
        if existing is not None:
            hint = ("revoked devices stay revoked; enroll it under a new name" if existing.state == REVOKED
                    else f"use 'broker-coordinator devices rotate {name}' for a new token")
            raise RegistryError(f"device {name!r} already exists ({existing.state}): {hint}")
        with self.connect() as db:
            db.execute("INSERT INTO devices (name, federation, state, password_hash, signing_key, token_id, "
                       "token_expires, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (name, federation, PENDING, password_hash, signing_key, token_id, token_expires, time.time()))
        return self.require(name)

    def reissue(self, name: str, password_hash: str, signing_key: str, token_id: str, token_expires: float) -> Device:
        """New one-time password, signing key and token: the device goes back to pending."""
        device = self.require(name)
        if device.state == REVOKED:
            raise RegistryError(f"device {name!r} is revoked; revoked devices stay revoked: enroll it under a new name")
        with self.connect() as db:
            db.execute("UPDATE devices SET state = ?, password_hash = ?, signing_key = ?, token_id = ?, "
                       "token_expires = ? WHERE name = ?",
                       (PENDING, password_hash, signing_key, token_id, token_expires, name))
        return self.require(name)

    def activate(self, name: str, token_id: str, password_hash: str, now: float | None = None) -> None:
        """Redeem the token: raise RegistryError with reason text if it cannot be redeemed."""
        now = time.time() if now is None else now
        with self.connect() as db:
            # one UPDATE that checks and consumes the token: two concurrent redemptions cannot both win
            changed = db.execute(
                "UPDATE devices SET state = ?, password_hash = ?, token_id = NULL, token_expires = NULL, "
                "enrolled_at = ? WHERE name = ? AND state = ? AND token_id = ? AND token_expires > ?",
                (ACTIVE, password_hash, now, name, PENDING, token_id, now)).rowcount
        if changed != 1:
            raise RegistryError(self._why_not_redeemable(name, token_id, now))

    def _why_not_redeemable(self, name: str, token_id: str, now: float) -> str:
        device = self.get(name)
        if device is None:
            return f"unknown_device: {name} is not in the registry"
        if device.state == REVOKED:
            return f"revoked: {name} was revoked"
        if device.state == ACTIVE or device.token_id != token_id:
            return f"used: this token for {name} was already used or replaced by a newer one"
        return f"expired: the token for {name} expired at {time.strftime('%Y-%m-%d %H:%M', time.localtime(device.token_expires or 0))}"

    def revoke(self, name: str) -> Device:
        device = self.require(name)
        if device.state == REVOKED:
            raise RegistryError(f"device {name!r} is already revoked")
        with self.connect() as db:
            db.execute("UPDATE devices SET state = ?, token_id = NULL, token_expires = NULL, revoked_at = ? "
                       "WHERE name = ?", (REVOKED, time.time(), name))
        return self.require(name)

    def signing_keys(self, federation: str | None = None) -> dict[str, bytes]:
        """device -> update-signing key, for active devices only (a revoked device's key is dropped)."""
        return {d.name: bytes.fromhex(d.signing_key) for d in self.devices(federation) if d.state == ACTIVE}

    def activity(self) -> dict[str, Activity]:
        """What the round store recorded per device (empty until the coordinator has run)."""
        with self.connect() as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            found: dict[str, Activity] = {}
            if "presence" in tables:
                for device, online, last_seen in db.execute("SELECT device, online, last_seen FROM presence"):
                    found[device] = Activity(bool(online), last_seen)
            if "device_rounds" in tables:
                columns = {r[1] for r in db.execute("PRAGMA table_info(device_rounds)")}
                # a left-out update was accepted but contributed nothing (older databases: no verdicts)
                counted = " AND (verdict IS NULL OR verdict != 'left_out')" if "verdict" in columns else ""
                for device, rounds, last in db.execute("SELECT device, COUNT(DISTINCT round), MAX(round) FROM "
                                                       f"device_rounds WHERE accepted = 1{counted} GROUP BY device"):
                    entry = found.setdefault(device, Activity())
                    entry.rounds, entry.last_round = rounds, last
        return found


@dataclass
class Activity:
    online: bool = False
    last_seen: float | None = None
    rounds: int = 0
    last_round: int | None = None


def _device(row: sqlite3.Row) -> Device:
    return Device(**dict(row))


def match_owner(path: Path) -> None:
    """When root creates a file in a service user's directory, hand it to that directory's owner,
    so that the CLI (run with sudo) and the service (its own user) can share it."""
    owner = directory_owner(path)
    if owner is not None:
        os.chown(path, *owner)


def directory_owner(path: Path) -> tuple[int, int] | None:
    """(uid, gid) a file created at `path` should have (see match_owner); None: leave it as created."""
    if os.geteuid() != 0:
        return None
    parent = path.parent.stat()
    return (parent.st_uid, parent.st_gid) if parent.st_uid != 0 or parent.st_gid != 0 else None
