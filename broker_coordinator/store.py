"""The coordinator's memory: SQLite for rounds and per-device metrics, and an
atomically replaced checkpoint file for the global model.

Order of writes after a round: checkpoint file first (it holds the round's
record too), then the database rows. On restart the checkpoint is the truth:
the next round is checkpoint.round + 1, and a round whose rows did not reach
the database is filled in from the checkpoint. So no round is aggregated twice.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgefl_protocol import codec
from edgefl_protocol.persist import atomic_write, pack, unpack

SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, closed TEXT NOT NULL,
    selected INTEGER, participants INTEGER, accuracy REAL, loss REAL, bytes_up INTEGER,
    seconds REAL, rejected TEXT, base_sha256 TEXT, model_sha256 TEXT, finished_at REAL,
    PRIMARY KEY (round, attempt));
CREATE TABLE IF NOT EXISTS device_rounds (
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, device TEXT NOT NULL,
    accepted INTEGER NOT NULL, reason TEXT, metrics TEXT, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS device_rounds_device ON device_rounds (device, round);
CREATE TABLE IF NOT EXISTS presence (
    device TEXT PRIMARY KEY, online INTEGER NOT NULL, last_seen REAL NOT NULL, profile TEXT);
"""
CHECKPOINT = "checkpoint.msgpack"


def model_sha256(weights: dict[str, np.ndarray]) -> str:
    return hashlib.sha256(codec.encode(weights, "float32").body).hexdigest()


@dataclass
class Checkpoint:
    round: int
    version: int
    arch: str
    weights: dict[str, np.ndarray]
    sha256: str
    server_state: dict[str, Any]
    record: dict[str, Any]
    served: dict[str, np.ndarray] | None = None  # the served moving average, when serve_average is on


class Store:
    def __init__(self, state_dir: Path | str) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.dir / "coordinator.db", check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._device_rows: list[tuple] = []  # buffered: one transaction per round, not one per update

    # checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, ckpt: Checkpoint) -> None:
        atomic_write(self.dir / CHECKPOINT, pack({
            "round": ckpt.round, "version": ckpt.version, "arch": ckpt.arch, "weights": ckpt.weights,
            "sha256": ckpt.sha256, "server_state": ckpt.server_state, "record": ckpt.record,
            "served": ckpt.served}))

    def load_checkpoint(self) -> Checkpoint | None:
        path = self.dir / CHECKPOINT
        if not path.exists():
            return None
        raw = unpack(path.read_bytes())
        ckpt = Checkpoint(raw["round"], raw["version"], raw["arch"], raw["weights"], raw["sha256"],
                          raw.get("server_state") or {}, raw.get("record") or {}, raw.get("served"))
        if model_sha256(ckpt.weights) != ckpt.sha256:
            raise ValueError(f"checkpoint {path} is corrupt: its weights do not match the recorded sha256")
        if ckpt.record and not self.db.execute("SELECT 1 FROM rounds WHERE round = ? AND closed != 'abandoned'",
                                               (ckpt.round,)).fetchone():
            self.record_round(ckpt.record)  # the crash came between checkpoint and database
        return ckpt

    # rounds and devices -----------------------------------------------------------
    def record_round(self, r: dict[str, Any]) -> None:
        """Write the round's row together with the device rows buffered since the last round."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT INTO device_rounds VALUES (?,?,?,?,?,?,?)", self._device_rows)
            self._insert_round(r)
        self._device_rows = []

    def _insert_round(self, r: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO rounds VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (r["round"], r["attempt"], r["closed"], r["selected"], r["participants"], r["accuracy"], r["loss"],
             r["bytes_up"], r["seconds"], json.dumps(r["rejected"]), r.get("base_sha256"), r.get("model_sha256"),
             time.time()))

    def record_device_round(self, round_no: int, attempt: int, device: str, accepted: bool, reason: str | None,
                            metrics: dict[str, Any] | None) -> None:
        self._device_rows.append((round_no, attempt, device, int(accepted), reason,
                                  json.dumps(metrics) if metrics is not None else None, time.time()))

    def record_presence(self, device: str, online: bool, profile: dict[str, Any]) -> None:
        self.db.execute("INSERT INTO presence VALUES (?,?,?,?) ON CONFLICT(device) DO UPDATE SET "
                        "online = excluded.online, last_seen = excluded.last_seen, "
                        "profile = COALESCE(excluded.profile, presence.profile)",
                        (device, int(online), time.time(), json.dumps(profile) if profile else None))

    def rounds(self) -> list[dict[str, Any]]:
        cursor = self.db.execute("SELECT * FROM rounds ORDER BY round, attempt")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    def devices(self) -> list[dict[str, Any]]:
        cursor = self.db.execute(
            "SELECT p.device, p.online, p.last_seen, p.profile, "
            "(SELECT COUNT(*) FROM device_rounds d WHERE d.device = p.device AND d.accepted = 1) AS rounds "
            "FROM presence p ORDER BY p.device")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    def close(self) -> None:
        self.db.close()
