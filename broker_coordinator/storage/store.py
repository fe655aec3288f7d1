"""The coordinator's memory: SQLite for rounds and per-device metrics, and an
atomically replaced checkpoint file for the global model.

Order of writes after a round: checkpoint file first (it holds the round's
record too), then the database rows. On restart the checkpoint is the truth:
the next round is checkpoint.round + 1, and a round whose rows did not reach
the database is filled in from the checkpoint (`recover_checkpoint`, by the
coordinator starting; `load_checkpoint` only reads, for readers beside a
running coordinator). So no round is aggregated or recorded twice.

History is append-only: every attempt of every round is its own row (attempt
numbers continue across restarts), and a rollback adds a `rollback` row
instead of deleting what came after. The last `keep` checkpoints are kept in
`checkpoints/`, so `broker-coordinator rollback --to ROUND` can go back.

A store is one task's (`tasks`): in a coordinator's state directory it is the current task, and
each row names its task; an archived task's directory (`tasks/<id>/`) is a store of its own.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefl_protocol import codec
from edgefl_protocol.persist import atomic_write, pack, unpack

SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, closed TEXT NOT NULL,
    selected INTEGER, participants INTEGER, accuracy REAL, loss REAL, bytes_up INTEGER,
    seconds REAL, rejected TEXT, base_sha256 TEXT, model_sha256 TEXT, finished_at REAL, reason TEXT,
    metric TEXT, score REAL, federated TEXT);
CREATE INDEX IF NOT EXISTS rounds_round ON rounds (round, attempt);
CREATE TABLE IF NOT EXISTS device_rounds (
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, device TEXT NOT NULL,
    accepted INTEGER NOT NULL, reason TEXT, metrics TEXT, at REAL NOT NULL, verdict TEXT, verdict_detail TEXT);
CREATE INDEX IF NOT EXISTS device_rounds_device ON device_rounds (device, round);
CREATE TABLE IF NOT EXISTS attempts (
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, started_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS presence (
    device TEXT PRIMARY KEY, online INTEGER NOT NULL, last_seen REAL NOT NULL, profile TEXT);
CREATE TABLE IF NOT EXISTS attempt_floor (round INTEGER PRIMARY KEY, attempt INTEGER NOT NULL);
"""
# attempt_floor: attempts of a round number that this store's rows do not hold (an earlier task's, or
# rounds the devices ran that a restored backup never saw: `tasks`, cli/task_start.py), so that its
# attempts go past them: a device remembers the (round, attempt) pairs it ran lately and would take a
# repeated pair for a task delivered twice
RAISE_FLOOR = ("INSERT INTO attempt_floor VALUES (?, ?) ON CONFLICT(round) DO UPDATE SET "
               "attempt = MAX(attempt, excluded.attempt)")
CHECKPOINT = "checkpoint.msgpack"
HISTORY_DIR = "checkpoints"
ROUND_COLUMNS = ("round", "attempt", "closed", "selected", "participants", "accuracy", "loss", "bytes_up",
                 "seconds", "rejected", "base_sha256", "model_sha256", "finished_at", "reason",
                 "metric", "score", "federated", "clipped", "left_out", "task", "epsilon")
# since the task's metric is named; since the fold's verdicts are recorded (clipped: {how: n}, left_out: fraction);
# since tasks (the id of the task the round belongs to; NULL outside a coordinator's state directory); since the
# dashboard (epsilon: the privacy budget spent by that round, [privacy] mode = "central")
ADDED_COLUMNS = {"metric": "TEXT", "score": "REAL", "federated": "TEXT", "clipped": "TEXT", "left_out": "REAL",
                 "task": "INTEGER", "epsilon": "REAL"}
# device_rounds: the fold's verdict on an accepted update (folded | clipped | left_out | pending) and its detail
DEVICE_COLUMNS = ("round", "attempt", "device", "accepted", "reason", "metrics", "at", "verdict", "verdict_detail")
ADDED_DEVICE_COLUMNS = {"verdict": "TEXT", "verdict_detail": "TEXT"}


# `devices()`: accepted answers per device, by the fold's verdict; "unjudged": evaluation reports, and
# updates recorded before verdicts were (or still pending)
VERDICT_COUNTS = {"folded": "d.verdict = 'folded'", "clipped": "d.verdict = 'clipped'",
                  "left_out": "d.verdict = 'left_out'",
                  "unjudged": "(d.verdict IS NULL OR d.verdict NOT IN ('folded', 'clipped', 'left_out'))"}


class StoreError(Exception):
    """The state directory cannot do what was asked; the message says what to do."""


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
    trust: dict[str, Any] = field(default_factory=dict)  # SampleWeights and NormBound state (see trust)
    downlink: dict[str, Any] = field(default_factory=dict)  # the broadcast model and its deltas (delta_downlink)
    server_optimizer: dict[str, Any] = field(default_factory=dict)  # its moments (aggregation/server_optimizer.py)


class Store:
    def __init__(self, state_dir: Path | str, keep: int = 10) -> None:
        self.dir = Path(state_dir)
        self.keep = keep
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "coordinator.db"
        if not path.exists():  # the device registry shares it: its signing keys are nobody else's to read
            path.touch(mode=0o600)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()
        self.db.executescript(SCHEMA)
        self._add_columns()
        self._device_rows: list[tuple] = []  # buffered: one transaction per round, not one per update
        self._accepted_rows: dict[tuple[int, int, str], int] = {}  # (round, attempt, device) -> its accepted row
        # device -> its latest presence row, buffered: one transaction per drain tick, not one per status
        self._presence: dict[str, tuple] = {}
        self._presence_since = 0.0  # monotonic time of the oldest buffered status
        self.task = current_task(self.db)  # the id its rows carry (None: no task index here)

    def _migrate(self) -> None:
        """Databases written before history became append-only keyed rounds on (round, attempt)
        and replaced rows; copy them into the new table once."""
        columns = [r[1] for r in self.db.execute("PRAGMA table_info(rounds)")]
        if not columns or "id" in columns:
            return
        shared = ", ".join(c for c in columns if c in ROUND_COLUMNS)
        rounds_table = SCHEMA.split("CREATE TABLE IF NOT EXISTS device_rounds")[0]
        self.db.executescript(f"BEGIN; ALTER TABLE rounds RENAME TO rounds_old; {rounds_table} "
                              f"INSERT INTO rounds ({shared}) SELECT {shared} FROM rounds_old ORDER BY round, attempt; "
                              "DROP TABLE rounds_old; COMMIT;")

    def _add_columns(self) -> None:
        """Databases from before a column existed get it (NULL in their old rows)."""
        for table, added in (("rounds", ADDED_COLUMNS), ("device_rounds", ADDED_DEVICE_COLUMNS)):
            columns = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in added.items():
                if name not in columns:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    # checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, ckpt: Checkpoint) -> None:
        data = _pack_checkpoint(ckpt)
        if self.keep > 0:  # the history first: the live checkpoint is never newer than what rollback can reach
            history = self.dir / HISTORY_DIR
            history.mkdir(mode=0o700, exist_ok=True)
            atomic_write(history / f"round-{ckpt.round:06d}.msgpack", data)
            for old in self.kept_rounds()[:-self.keep]:
                (history / f"round-{old:06d}.msgpack").unlink(missing_ok=True)
        atomic_write(self.dir / CHECKPOINT, data)

    def load_checkpoint(self) -> Checkpoint | None:
        """The live checkpoint, read only: safe beside a running coordinator (`status`, a test, a drill)."""
        path = self.dir / CHECKPOINT
        return read_checkpoint(path) if path.exists() else None

    def recover_checkpoint(self) -> Checkpoint | None:
        """The live checkpoint, with its round's row written if a crash came between checkpoint and
        database. Only for the process that holds the state lock (the coordinator starting, a
        rollback): beside a running coordinator, that gap is the moment between its two writes, and
        the row written here would be written again by the coordinator, the round recorded twice."""
        ckpt = self.load_checkpoint()
        if ckpt and ckpt.record and not self.db.execute(
                "SELECT 1 FROM rounds WHERE round = ? AND model_sha256 = ? AND closed != 'abandoned'",
                (ckpt.round, ckpt.sha256)).fetchone():
            self.record_round(ckpt.record)
        return ckpt

    def kept_rounds(self) -> list[int]:
        history = self.dir / HISTORY_DIR
        names = sorted(history.glob("round-*.msgpack")) if history.is_dir() else []
        return [int(p.stem.split("-")[1]) for p in names if p.stem.split("-")[1].isdigit()]

    def rollback(self, to_round: int) -> Checkpoint:
        """Make the kept checkpoint of `to_round` the live one. Its model gets a new version number
        (one past the newest), so that no device mistakes it for a model it already holds; the
        rounds after it stay in the history, marked by a `rollback` row."""
        path = self.dir / HISTORY_DIR / f"round-{to_round:06d}.msgpack"
        if not path.exists():
            kept = self.kept_rounds()
            raise StoreError(f"no checkpoint of round {to_round} is kept in {path.parent}; kept rounds: "
                             f"{', '.join(map(str, kept)) or 'none'} (raise [storage] keep_checkpoints to keep more)")
        target = read_checkpoint(path)
        current = self.recover_checkpoint()
        newest = max([target.version] + ([current.version] if current else []))
        if current is not None and "privacy" in current.trust:  # a rollback never refunds epsilon
            target.trust["privacy"] = current.trust["privacy"]
        target.version = newest + 1
        atomic_write(self.dir / CHECKPOINT, _pack_checkpoint(target))
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("INSERT INTO rounds (round, attempt, closed, model_sha256, finished_at, reason, task) "
                            "VALUES (?, 0, 'rollback', ?, ?, ?, ?)",
                            (to_round, target.sha256, time.time(),
                             f"rolled back from round {current.round if current else '?'}; model version "
                             f"{target.version}", self.task))
        return target

    def start_attempt(self, round_no: int, attempt: int) -> None:
        """Written before any task of the attempt goes out: after a crash, the next attempt of the
        round gets a new number, so an answer to the lost attempt cannot pass for an answer to it."""
        self.db.execute("INSERT INTO attempts VALUES (?, ?, ?)", (round_no, attempt, time.time()))

    def last_attempt(self, round_no: int) -> int:
        row = self.db.execute("SELECT MAX(a) FROM (SELECT MAX(attempt) AS a FROM rounds WHERE round = ? UNION ALL "
                              "SELECT MAX(attempt) FROM attempts WHERE round = ? UNION ALL "
                              "SELECT attempt FROM attempt_floor WHERE round = ?)",
                              (round_no, round_no, round_no)).fetchone()
        return int(row[0] or 0)

    def floor_attempts(self, rounds: dict[int, int]) -> None:
        """Attempts of each round (round -> attempt) that happened outside this store's knowledge (an
        earlier task's, or rounds a restored backup never saw): its next attempt goes past them."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(RAISE_FLOOR, sorted(rounds.items()))

    # rounds and devices -----------------------------------------------------------
    def record_round(self, r: dict[str, Any]) -> None:
        """Write the round's row together with the device rows buffered since the last round."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(f"INSERT INTO device_rounds ({', '.join(DEVICE_COLUMNS)}) VALUES "
                                f"({', '.join('?' * len(DEVICE_COLUMNS))})", self._device_rows)
            self._write_presence()
            self._insert_round(r)
        self._device_rows = []
        self._accepted_rows = {}

    def _insert_round(self, r: dict[str, Any]) -> None:
        self.db.execute(
            f"INSERT INTO rounds ({', '.join(ROUND_COLUMNS)}) VALUES ({', '.join('?' * len(ROUND_COLUMNS))})",
            (r["round"], r["attempt"], r["closed"], r["selected"], r["participants"], r["accuracy"], r["loss"],
             r["bytes_up"], r["seconds"], json.dumps(r["rejected"]), r.get("base_sha256"), r.get("model_sha256"),
             time.time(), r.get("reason", ""), r.get("metric"), r.get("score"),
             json.dumps(r["federated"]) if r.get("federated") else None,
             json.dumps(r["clipped"]) if r.get("clipped") else None, r.get("left_out"), self.task,
             (r.get("privacy") or {}).get("epsilon")))

    def record_device_round(self, round_no: int, attempt: int, device: str, accepted: bool, reason: str | None,
                            metrics: dict[str, Any] | None, verdict: str | None = None,
                            verdict_detail: str | None = None) -> None:
        if accepted:
            self._accepted_rows[(round_no, attempt, device)] = len(self._device_rows)
        self._device_rows.append((round_no, attempt, device, int(accepted), reason,
                                  json.dumps(metrics) if metrics is not None else None, time.time(),
                                  verdict or None, verdict_detail or None))

    def settle_verdict(self, round_no: int, attempt: int, device: str, verdict: str, detail: str) -> None:
        """The final verdict on an accepted update recorded as pending (or, for an abandoned attempt,
        as folded): in the buffered row, or in the row already written."""
        i = self._accepted_rows.get((round_no, attempt, device))
        if i is not None:  # a dict, not a scan: a round of 1,000 updates settles 1,000 verdicts
            self._device_rows[i] = (*self._device_rows[i][:7], verdict, detail or None)
            return
        self.db.execute("UPDATE device_rounds SET verdict = ?, verdict_detail = ? WHERE round = ? AND attempt = ? "
                        "AND device = ? AND accepted = 1", (verdict, detail or None, round_no, attempt, device))

    def record_presence(self, device: str, online: bool, profile: dict[str, Any]) -> None:
        """Buffered (the latest status per device); written by `flush_presence`, which the
        coordinator calls from its drain loop, by `record_round`, and by `close`."""
        row = (device, int(online), time.time(), json.dumps(profile) if profile else None)
        earlier = self._presence.get(device)
        if row[3] is None and earlier is not None:  # an offline status keeps the last known profile
            row = (*row[:3], earlier[3])
        if not self._presence:
            self._presence_since = time.monotonic()
        self._presence[device] = row

    def flush_presence(self, older_than: float = 0.0) -> None:
        """Write the buffered statuses in one transaction, once the oldest has waited `older_than` s."""
        if not self._presence or time.monotonic() - self._presence_since < older_than:
            return
        with self.db:
            self.db.execute("BEGIN")
            self._write_presence()

    def _write_presence(self) -> None:
        self.db.executemany("INSERT INTO presence VALUES (?,?,?,?) ON CONFLICT(device) DO UPDATE SET "
                            "online = excluded.online, last_seen = excluded.last_seen, "
                            "profile = COALESCE(excluded.profile, presence.profile)", list(self._presence.values()))
        self._presence = {}

    def rounds(self) -> list[dict[str, Any]]:
        cursor = self.db.execute("SELECT * FROM rounds ORDER BY id")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    def devices(self) -> list[dict[str, Any]]:
        self.flush_presence()
        cursor = self.db.execute(
            "SELECT p.device, p.online, p.last_seen, p.profile, "
            "(SELECT COUNT(*) FROM device_rounds d WHERE d.device = p.device AND d.accepted = 1) AS rounds, "
            + ", ".join(f"(SELECT COUNT(*) FROM device_rounds d WHERE d.device = p.device AND d.accepted = 1 "
                        f"AND {where}) AS {name}" for name, where in VERDICT_COUNTS.items())
            + ", (SELECT d.verdict FROM device_rounds d WHERE d.device = p.device ORDER BY d.rowid DESC LIMIT 1) "
              "AS last_verdict FROM presence p ORDER BY p.device")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    def close(self) -> None:
        self.flush_presence()  # the last state of every device survives a shutdown
        self.db.close()


def current_task(db: sqlite3.Connection) -> int | None:
    """The current task's id from the task index (`tasks`), None where there is none."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tasks'").fetchone():
        return None
    row = db.execute("SELECT id FROM tasks WHERE ended_at IS NULL ORDER BY id DESC LIMIT 1").fetchone()
    return int(row[0]) if row else None


def _pack_checkpoint(ckpt: Checkpoint) -> bytes:
    return pack({"round": ckpt.round, "version": ckpt.version, "arch": ckpt.arch, "weights": ckpt.weights,
                 "sha256": ckpt.sha256, "server_state": ckpt.server_state, "record": ckpt.record,
                 "served": ckpt.served, "trust": ckpt.trust, "downlink": ckpt.downlink,
                 "server_optimizer": ckpt.server_optimizer})


def read_checkpoint(path: Path) -> Checkpoint:
    raw = unpack(path.read_bytes())
    ckpt = Checkpoint(raw["round"], raw["version"], raw["arch"], raw["weights"], raw["sha256"],
                      raw.get("server_state") or {}, raw.get("record") or {}, raw.get("served"),
                      raw.get("trust") or {}, raw.get("downlink") or {}, raw.get("server_optimizer") or {})
    if model_sha256(ckpt.weights) != ckpt.sha256:
        raise ValueError(f"checkpoint {path} is corrupt: its weights do not match the recorded sha256")
    return ckpt
