"""Tasks: the training runs of one federation, one after another, for the same enrolled devices.

A task is one model trained from a fresh start. Its definition is what gives the model's numbers
their meaning (`TaskDefinition`, built from the config by `cli/task_start.py`):

    model        [federation] model, with the model's fingerprint (parameter names, shapes and
                 dtypes: a package upgrade that builds another network under the same name is
                 another model)
    task, loss   [federation] task and loss (the loss resolved: "" is the task's default)
    algorithm    [algorithm] algorithm (the server rule's state belongs to it)
    test data    the sha256 of the file [federation] test_data names ("" = none: the devices evaluate)

Everything else (hyper-parameters, the fold, the schedule, pacing, privacy, codecs) tunes the
current task. When the config's definition differs from the current task's, `run` starts a new
task (`Tasks.begin`): the current one is archived with its rounds and checkpoints, the new one
starts at round 1 from a fresh model, and the device registry is not touched.

A state directory:

    coordinator.db      the device registry and presence, the task index (`tasks`), and the current
                        task's rows (`rounds`, `device_rounds`, `attempts`, `attempt_floor`)
    checkpoint.msgpack  the current task's live checkpoint; checkpoints/ its kept rounds;
    pacing.json         its pacer's state
    tasks/<id>/         an archived task: coordinator.db with its rows only (a `Store` opens it),
                        its checkpoints, pacing.json, and task.json (its definition and summary)

A state directory of release 0.1 (coordinator.db and the checkpoints, no task index) is task 1 in
place. A switch runs in an order that the next start can finish after a crash at any point:
  1. the task's files are linked (or copied) and its rows copied into tasks/.<id>.partial, which is
     renamed tasks/<id> once complete;
  2. one transaction ends the task with its summary, clears its rows and starts the next one;
  3. the task's files at the top are removed.
A start that finds tasks/<id> for the task still current redoes 2 and 3 (or, when the config went
back to that task, drops the copy, putting back any file 3 had removed); one that finds files of the
task before at the top, byte for byte as archived, beside a task with no rounds finishes 3.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from edgefl_protocol.persist import file_sha256

from broker_coordinator.storage.store import CHECKPOINT, HISTORY_DIR, RAISE_FLOOR, Store, read_checkpoint

DATABASE = "coordinator.db"
ARCHIVE = "tasks"
TASK_FILE = "task.json"
TASK_TABLES = ("rounds", "device_rounds", "attempts", "attempt_floor")
# the current task's files at the top of the state directory; pacing.json is the pacer's (engine/pacing.py):
# its best score is the old model's, no yardstick for the new one
TASK_FILES = (HISTORY_DIR, CHECKPOINT, "pacing.json")
# a new task's first rounds number their attempts past those the last task used for the same round
# numbers (store.attempt_floor): a device remembers the last 16 tasks it ran, 64 rounds if in 1 of 4
REMEMBERED_ROUNDS = 64
SCORED = "closed IN ('complete', 'deadline', 'evaluated')"  # rounds that made or measured a model
APPLIED = "closed IN ('complete', 'deadline', 'evaluated', 'rollback')"  # ... or made one live again
LAST_SCORE = ("SELECT COALESCE(score, accuracy), COALESCE(metric, 'accuracy') FROM rounds "
              f"WHERE {SCORED} AND COALESCE(score, accuracy) IS NOT NULL ORDER BY id DESC LIMIT 1")
INDEX = """
CREATE TABLE IF NOT EXISTS tasks (
    id INTEGER PRIMARY KEY,
    fingerprint TEXT NOT NULL,        -- sha256 of the definition
    definition TEXT NOT NULL,         -- JSON: model, model_fingerprint, task, loss, algorithm, test_data
    started_at REAL NOT NULL,
    ended_at REAL,                    -- NULL: the current task
    first_version INTEGER NOT NULL,   -- its model versions start here, past every earlier task's
    last_round INTEGER, last_version INTEGER, last_score REAL, metric TEXT,  -- its summary once archived
    checkpoint_sha256 TEXT,           -- the archived live checkpoint file's sha256
    note TEXT);
"""


@dataclass(frozen=True)
class TaskDefinition:
    model: str
    model_fingerprint: str
    task: str
    loss: str
    algorithm: str
    test_data: str  # sha256 of the coordinator's test set file; "" = none

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        if not self.task:  # a task of release 0.1 whose model differs from the config's: only the model is known
            return f"model {self.model}"
        test = f"test data {self.test_data[:12]}" if self.test_data else "no test data"
        return f"model {self.model}, {self.task} ({self.loss}), {self.algorithm}, {test}"

    def changes(self, before: TaskDefinition) -> str:
        """What differs from `before`, e.g. "model logreg60 -> synthetic_mlp"."""
        def shown(name: str, value: str) -> str:
            return (value[:12] if name == "test_data" else value) or "none"
        known = [f.name for f in fields(self) if f.name != "model_fingerprint" and (before.task or f.name == "model")]
        changed = [f"{name.replace('_', ' ')} {shown(name, getattr(before, name))} -> "
                   f"{shown(name, getattr(self, name))}" for name in known if getattr(before, name) != getattr(self, name)]
        if not changed and before.model_fingerprint != self.model_fingerprint:
            changed.append(f"model {self.model}'s parameters (another version of its package)")
        return ", ".join(changed)

    @classmethod
    def from_json(cls, text: str) -> TaskDefinition:
        raw = json.loads(text)
        return cls(**{f.name: str(raw.get(f.name, "")) for f in fields(cls)})


@dataclass
class Task:
    id: int
    definition: TaskDefinition
    started_at: float
    ended_at: float | None  # None: the current task
    first_version: int
    last_round: int | None = None
    last_version: int | None = None
    last_score: float | None = None
    metric: str | None = None
    checkpoint_sha256: str | None = None
    note: str = ""

    @property
    def current(self) -> bool:
        return self.ended_at is None


@dataclass
class Started:
    """What `Tasks.begin` found or did: the task to run, the task it replaced, or a migration."""
    task: Task
    previous: Task | None = None  # archived just now in favour of `task`
    migrated: bool = False  # a state directory of release 0.1 became task 1 in place
    fresh: bool = False  # a first task in an empty state directory


class Tasks:
    """The task index of a coordinator's state directory. `begin` only by the process that holds the
    state lock (`run` starting); `read_tasks` reads beside a running coordinator."""

    def __init__(self, state_dir: Path | str) -> None:
        self.dir = Path(state_dir)
        self.store = Store(self.dir)  # the current task's tables, brought up to date
        self.db = self.store.db
        self.db.executescript(INDEX)

    def close(self) -> None:
        self.store.close()

    def begin(self, definition: TaskDefinition) -> Started:
        """The task to run for `definition`: the current one, or a new one after archiving it."""
        for partial in (self.dir / ARCHIVE).glob(".*.partial"):  # a copy a crash left unfinished
            shutil.rmtree(partial, ignore_errors=True)
        current = self._current()
        if current is None:
            return self._first(definition)
        self._finish_removal(current)
        if current.definition.fingerprint == definition.fingerprint:
            self._drop_unfinished_archive(current)
            return Started(current)
        self.store.recover_checkpoint()  # a round checkpointed just before the last stop is part of it
        return Started(*self._switch(current, definition))

    def _first(self, definition: TaskDefinition) -> Started:
        """Task 1: a fresh directory's, or a directory of release 0.1 taken over in place (its model
        from the checkpoint; the rest of its definition is the config's when the model is the same)."""
        ckpt = self.store.recover_checkpoint()
        first_version = int(self.db.execute("SELECT COALESCE(MAX(last_version) + 1, 0) FROM tasks").fetchone()[0])
        if ckpt is None and not self.db.execute("SELECT 1 FROM rounds LIMIT 1").fetchone():
            self._insert(definition, first_version, "")
            return Started(self._need_current(), fresh=True)
        adopted = definition if ckpt is None or ckpt.arch == definition.model else \
            TaskDefinition(ckpt.arch, "", "", "", "", "")

        def take_over() -> None:
            self._insert(adopted, first_version, "release 0.1 state directory, taken over in place")
            self.db.execute("UPDATE rounds SET task = (SELECT MAX(id) FROM tasks) WHERE task IS NULL")
        self._transaction(take_over)
        migrated = self._need_current()
        if adopted is definition:
            return Started(migrated, migrated=True)
        task, ended = self._switch(migrated, definition)  # the config names another model: a new task at once
        return Started(task, ended, migrated=True)

    # a switch: steps 1-3 of the module docstring ------------------------------------------------
    def _switch(self, task: Task, definition: TaskDefinition) -> tuple[Task, Task]:
        """Archive `task` and start one for `definition`; (the new task, the archived one)."""
        final = self.dir / ARCHIVE / str(task.id)
        # the live checkpoint; from the copy when a backup caught the top already cleared (step 3 of a
        # switch that step 2 of the backed-up database had not seen)
        live = next((p for p in (self.dir / CHECKPOINT, final / CHECKPOINT) if p.exists()), None)
        ckpt = read_checkpoint(live) if live else None
        last = self.db.execute(LAST_SCORE).fetchone()
        ended = Task(task.id, task.definition, task.started_at, time.time(), task.first_version,
                     ckpt.round if ckpt else 0, ckpt.version if ckpt else None, last[0] if last else None,
                     last[1] if last else None, file_sha256(live) if live else None, task.note)
        if not final.exists():
            self._copy_out(ended, final)
        floor = self._attempt_floor()
        # past every version the task published: its last, or the fresh model it published first
        next_version = max(task.first_version, ended.last_version or 0) + 1

        def commit() -> None:
            self.db.executemany(RAISE_FLOOR, floor)
            for table in TASK_TABLES[:-1]:  # the floor stays: it is about the devices, not the task
                self.db.execute(f"DELETE FROM {table}")
            self.db.execute("UPDATE tasks SET ended_at = ?, last_round = ?, last_version = ?, last_score = ?, "
                            "metric = ?, checkpoint_sha256 = ? WHERE id = ?",
                            (ended.ended_at, ended.last_round, ended.last_version, ended.last_score, ended.metric,
                             ended.checkpoint_sha256, task.id))
            self._insert(definition, next_version, "")
        self._transaction(commit)
        self._remove_top_files()
        return self._need_current(), ended

    def _copy_out(self, task: Task, final: Path) -> None:
        """Step 1: tasks/.<id>.partial gets the task's files (hard links) and rows, then becomes `final`."""
        partial = final.parent / f".{task.id}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        partial.mkdir(mode=0o700)
        for name in TASK_FILES:
            _link(self.dir / name, partial / name)
        Store(partial).close()  # the archive's tables, as a Store makes them

        def copy_rows() -> None:
            for table in TASK_TABLES:
                names = _shared_columns(self.db, table)
                self.db.execute(f"INSERT INTO archive.{table} ({names}) SELECT {names} FROM main.{table}")
        self.db.execute("ATTACH DATABASE ? AS archive", (str(partial / DATABASE),))
        try:
            self._transaction(copy_rows)
        finally:
            self.db.execute("DETACH DATABASE archive")
        (partial / TASK_FILE).write_text(json.dumps(asdict(task), indent=1) + "\n")
        _fsync_tree(partial)
        os.rename(partial, final)
        _fsync_tree(final.parent, recurse=False)

    def _attempt_floor(self) -> list[tuple[int, int]]:
        """(round, highest attempt) over the task's last REMEMBERED_ROUNDS round numbers."""
        recent = [r for (r,) in self.db.execute("SELECT round FROM (SELECT round FROM rounds UNION SELECT round "
                                                "FROM attempts) ORDER BY round DESC LIMIT ?", (REMEMBERED_ROUNDS,))]
        if not recent:
            return []
        return self.db.execute(f"SELECT round, MAX(attempt) FROM (SELECT round, attempt FROM rounds UNION ALL "
                               f"SELECT round, attempt FROM attempts) WHERE round IN ({','.join('?' * len(recent))}) "
                               "GROUP BY round", recent).fetchall()

    def _remove_top_files(self) -> None:
        """Step 3 (the history first: a live checkpoint never outlives the rounds rollback can reach)."""
        for name in TASK_FILES:
            path = self.dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        _fsync_tree(self.dir, recurse=False)

    # a switch a crash interrupted ---------------------------------------------------------------
    def _finish_removal(self, current: Task) -> None:
        """After step 2, before 3 finished: what is left at the top of the task before, byte for byte
        the same as its archived copy, goes (a file the current task wrote since differs)."""
        row = self.db.execute("SELECT * FROM tasks WHERE id < ? ORDER BY id DESC LIMIT 1", (current.id,)).fetchone()
        copy = self.dir / ARCHIVE / str(row[0]) if row else None
        if copy is None or not copy.is_dir() or self.db.execute(
                "SELECT 1 FROM rounds UNION SELECT 1 FROM attempts LIMIT 1").fetchone():
            return
        for name in TASK_FILES:
            top = self.dir / name
            for left in sorted(top.iterdir()) if top.is_dir() else [top] if top.exists() else []:
                archived = copy / left.relative_to(self.dir)
                if archived.is_file() and file_sha256(archived) == file_sha256(left):
                    left.unlink()
            if top.is_dir() and not any(top.iterdir()):
                top.rmdir()

    def _drop_unfinished_archive(self, current: Task) -> None:
        """After step 1, before 2, and the config is back at the current task: the top is the truth
        (what step 3 removed of it, in a backup taken in between, comes back from the copy)."""
        copy = self.dir / ARCHIVE / str(current.id)
        if not copy.exists():
            return
        for name in TASK_FILES:
            if not (self.dir / name).exists() and (copy / name).exists():
                _link(copy / name, self.dir / name)
        shutil.rmtree(copy)

    # the index ----------------------------------------------------------------------------------
    def _current(self) -> Task | None:
        row = self.db.execute("SELECT * FROM tasks WHERE ended_at IS NULL ORDER BY id DESC LIMIT 1").fetchone()
        return _task(row) if row else None

    def _need_current(self) -> Task:
        task = self._current()
        assert task is not None, "a task was just started"
        return task

    def _insert(self, definition: TaskDefinition, first_version: int, note: str) -> None:
        self.db.execute("INSERT INTO tasks (fingerprint, definition, started_at, first_version, note) "
                        "VALUES (?, ?, ?, ?, ?)", (definition.fingerprint, json.dumps(asdict(definition)),
                                                   time.time(), first_version, note or None))

    def _transaction(self, work: Callable[[], object]) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            work()
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")


def read_tasks(state_dir: Path | str) -> list[Task]:
    """Every task, oldest first, the current one with its rounds so far; safe beside a running
    coordinator (reads only). A directory of release 0.1 not yet started by this release shows
    its rounds as task 1, which the next `run` records."""
    state = Path(state_dir)
    if not (state / DATABASE).exists():
        return []
    db = sqlite3.connect(state / DATABASE, timeout=10)
    db.row_factory = sqlite3.Row
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        tasks = [_task(r) for r in db.execute("SELECT * FROM tasks ORDER BY id")] if "tasks" in tables else []
        if not tasks and "rounds" in tables and db.execute("SELECT 1 FROM rounds LIMIT 1").fetchone():
            ckpt = read_checkpoint(state / CHECKPOINT) if (state / CHECKPOINT).exists() else None
            tasks = [Task(1, TaskDefinition(ckpt.arch if ckpt else "?", "", "", "", "", ""), 0.0, None, 0,
                          note="release 0.1 state directory: the next 'run' records it as task 1")]
        current = next((t for t in tasks if t.current), None)
        if current is not None and "rounds" in tables:
            applied = db.execute(f"SELECT round FROM rounds WHERE {APPLIED} ORDER BY id DESC LIMIT 1").fetchone()
            scored = db.execute(LAST_SCORE).fetchone()
            current.last_round = applied[0] if applied else 0
            current.last_score, current.metric = (scored[0], scored[1]) if scored else (None, None)
        return tasks
    finally:
        db.close()


def _task(row: sqlite3.Row | tuple) -> Task:
    (id_, _, definition, started, ended, first, last_round, last_version, score, metric, sha, note) = tuple(row)
    return Task(id_, TaskDefinition.from_json(definition), started, ended, first, last_round, last_version, score,
                metric, sha, note or "")


def _shared_columns(db: sqlite3.Connection, table: str) -> str:
    """The columns `table` has in the current task's database and in the archive's, comma-separated."""
    archive = {r[1] for r in db.execute(f"PRAGMA archive.table_info({table})")}
    return ", ".join(r[1] for r in db.execute(f"PRAGMA main.table_info({table})") if r[1] in archive)


def _link(source: Path, target: Path) -> None:
    """`target` as a hard link of `source` (a copy across file systems); directories file by file."""
    if source.is_dir():
        target.mkdir(mode=0o700, exist_ok=True)
        for child in sorted(source.iterdir()):
            _link(child, target / child.name)
    elif source.exists():
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def _fsync_tree(path: Path, recurse: bool = True) -> None:
    """Files and directories on disk before a rename makes them count."""
    for item in sorted(path.rglob("*")) if recurse else []:
        if item.is_file():
            fd = os.open(item, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


