"""A spool directory that the device's own application keeps writing to.

The writer puts small `.npz` (x, y) or `.csv` batches in it by atomic rename,
each under a unique name (write `name.tmp` or `.name`, then rename; names not
ending in .npz/.csv and dot-files are never touched). Each `read()` (once a
round) ingests only files it has not seen and keeps the newest `window`
samples in memory, so memory is bounded by the window, not the history. A
backlog (the agent was down for a week) is read newest first and only as far
as the window reaches; older files are consumed unread (`not_read`).

What happens to a file once read (`consume`):
- "move" (default): into `consumed/`. A round lists only what is new, so its
  cost stays flat however many files came before, and a restart finds only new
  files. Nothing the application wrote is destroyed.
- "delete": into `consumed/` too, deleted once its samples leave the window:
  the disk holds the window and no more.
- "keep": left in place (a read-only spool works). A cursor (the newest
  change time read, and the names read within the last few seconds, since
  renames in the same tick share a time) says what is new; a round lists and
  stats the whole directory, so its cost grows with it.

A broken file (truncated, bad zip, NaN, wrong dtype or label type, samples of
another shape than [data] shape or, without it, the window's first file) is skipped with one
logged line and counted in `skipped`; it moves to `rejected/` (in "keep" mode
the cursor passes it), so it is never retried.

After a restart the window is rebuilt by re-reading the files (rows) named in
`<state_dir>/spool.msgpack`, written after every read that changed something:
a few hundred names, not the samples, so the SD card sees kilobytes per round.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.sources.base import DataError, LocalData, held_out_mask
from edge_agent.sources.files import MAX_FILE_BYTES, read_file
from edgefl_protocol.persist import atomic_write, pack, unpack
from edgefl_models.datasets import Dataset

log = logging.getLogger("edge_agent.data")
STATE_FILE = "spool.msgpack"
SUFFIXES = (".npz", ".csv")
KEEP_SLACK_NS = 5_000_000_000  # "keep": names read this close to the cursor are remembered, not trusted to time


@dataclass
class _Batch:
    name: str
    start: int  # row of the file where the window's part of it begins
    data: Dataset
    held: np.ndarray  # bool per row: held out for evaluation


class SpoolSource:
    def __init__(self, path: Path, task: str, *, window: int, holdout: float, consume: str = "move",
                 label_column: str = "label", shape: tuple[int, ...] = (), state_dir: Path | None = None) -> None:
        self.dir, self.task, self.window, self.holdout, self.consume = path, task, window, holdout, consume
        self.label_column, self.shape = label_column, tuple(shape)
        self.consumed, self.rejected = path / "consumed", path / "rejected"
        self.state_path = state_dir / STATE_FILE if state_dir else None
        self.batches: deque[_Batch] = deque()
        self.samples = 0
        self.skipped: Counter[str] = Counter()  # reason -> files skipped
        self.files_read = 0  # good files ingested by this process
        self.new_files = 0  # in the last read
        self.not_read = 0  # files older than a backlog's newest window, consumed unread
        self.sample_shape: tuple[int, ...] | None = self.shape or None  # x per sample; the first file fixes it
        self.label_shape: tuple[int, ...] | None = None
        self.cursor_ns = 0  # "keep": newest change time read
        self.recent: dict[str, int] = {}  # "keep": name -> change time, for names near the cursor
        self.cached: LocalData | None = None
        self.restored: set[str] = set()  # window files from before a restart, until the first read
        self._restore()

    # -- one round --------------------------------------------------------------------------------
    def read(self) -> LocalData:
        if not self.dir.is_dir():
            raise DataError(f"spool directory {self.dir} does not exist yet: start the application that writes "
                            f"it, or fix [data] path", "missing")
        if self.consume != "keep":
            try:
                self.consumed.mkdir(exist_ok=True)
            except OSError as exc:
                raise DataError(f"cannot create {self.consumed} ({exc.strerror}): the agent needs write access to "
                                f"the spool directory, or set [data] consume = \"keep\"", "permission") from None
        new = sorted(self._list_new())
        fresh: list[tuple[str, Dataset]] = []
        rows, unread = 0, 0
        for index in range(len(new) - 1, -1, -1):  # newest first: a backlog is read only as far as the window
            if rows >= self.window:
                unread = index + 1
                break
            _, name, size, changed = new[index]
            data = self._load(name, size, changed)
            if data is not None:
                fresh.append((name, data))
                rows += len(data)
        for _, name, _, changed in new[:unread]:
            self._pass_over(name, changed)
        if unread:
            log.info("spool %s: %d older files not read: the newest files fill the window of %d samples",
                     self.dir, unread, self.window)
        for name, data in reversed(fresh):
            self._add(name, 0, data)
            self.files_read += 1
            self._retire(name)
        self.new_files, self.not_read = len(new), self.not_read + unread
        self.restored.clear()
        floor = self.cursor_ns - KEEP_SLACK_NS
        self.recent = {name: t for name, t in self.recent.items() if t >= floor}
        if new:
            self.cached = None
            self._save()
        if self.samples == 0:
            raise DataError(f"spool {self.dir}: no samples yet ({sum(self.skipped.values())} files skipped); "
                            f"waiting for the application to write .npz or .csv files", "empty")
        if self.cached is None:
            self.cached = LocalData(self._gather(False), self._gather(True))
        if len(self.cached.train) == 0:
            raise DataError(f"spool {self.dir}: all {self.samples} samples so far are held out for evaluation; "
                            f"waiting for more", "empty")
        return self.cached

    def describe(self) -> str:
        skipped = sum(self.skipped.values())
        return (f"spool {self.dir}: {self.samples:,} samples in window ({self.new_files} new files"
                + (f", {skipped} skipped: {', '.join(f'{k} {v}' for k, v in sorted(self.skipped.items()))}"
                   if skipped else "") + ")")

    # -- what is new ------------------------------------------------------------------------------
    def _list_new(self) -> list[tuple[int, str, int, int]]:
        """(order time, name, size, change time) of files not read before; in "move"/"delete" mode
        everything listed is new, and the directory holds only what arrived since the last round."""
        new = []
        floor = self.cursor_ns - KEEP_SLACK_NS
        with os.scandir(self.dir) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(".") or not name.lower().endswith(SUFFIXES):
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # renamed away by the writer between listing and stat
                    continue
                if self.consume == "keep" and (stat.st_ctime_ns < floor or name in self.recent):
                    continue
                new.append((stat.st_mtime_ns, name, stat.st_size, stat.st_ctime_ns))
        return new

    def _load(self, name: str, size: int, changed: int) -> Dataset | None:
        """The file's samples, or None (skipped with a logged reason, or already in the window)."""
        path = self.dir / name
        if self.consume == "keep":
            self.recent[name] = changed
            self.cursor_ns = max(self.cursor_ns, changed)
        elif name in self.restored:  # a move that a crash interrupted: already in the window
            self._retire(name)
            return None
        try:
            if size > MAX_FILE_BYTES:
                raise DataError(f"{path}: {size >> 20} MB exceeds the {MAX_FILE_BYTES >> 20} MB limit per file",
                                "oversized")
            data = self._fit(read_file(path, self.task, self.label_column, self.shape), path)
        except DataError as exc:
            if exc.reason != "missing":  # "missing": taken away by someone else since the listing
                self._reject(name, exc.reason, str(exc))
            return None
        except Exception as exc:  # a hostile file must never stop the agent
            self._reject(name, "unreadable", f"{path}: {type(exc).__name__}: {exc}")
            return None
        return data

    def _pass_over(self, name: str, changed: int) -> None:
        """A file older than the newest window's worth: never read, consumed as if it had aged out."""
        if self.consume == "keep":
            self.recent[name] = changed
            self.cursor_ns = max(self.cursor_ns, changed)
        elif self.consume == "move" or name in self.restored:
            self._retire(name)
        else:
            try:
                (self.dir / name).unlink()
            except OSError:
                pass

    def _fit(self, data: Dataset, path: Path) -> Dataset:
        """Every file's samples must have the shape of the spool's first (or of [data] shape)."""
        if self.sample_shape is None:
            self.sample_shape = tuple(data.x.shape[1:])
        if self.label_shape is None:
            self.label_shape = tuple(data.y.shape[1:])
        if data.x.shape[1:] != self.sample_shape:
            origin = "[data] shape" if self.shape else "set by its first file; pin it with [data] shape"
            raise DataError(f"{path}: samples of shape {data.x.shape[1:]}, but this spool's samples are "
                            f"{self.sample_shape} ({origin})", "wrong_shape")
        if data.y.shape[1:] != self.label_shape:
            raise DataError(f"{path}: labels of shape {data.y.shape[1:]}, but this spool's labels are "
                            f"{self.label_shape}", "wrong_shape")
        return data

    # -- the window -------------------------------------------------------------------------------
    def _gather(self, held: bool) -> Dataset:
        """The window's held-out (or training) rows in one array, filled in place: memory is the
        window plus one copy of it, never a concatenation's extra copies."""
        first = self.batches[0].data
        n = sum(int((b.held == held).sum()) for b in self.batches)
        x, y = np.empty((n, *first.x.shape[1:]), first.x.dtype), np.empty((n, *first.y.shape[1:]), first.y.dtype)
        at = 0
        for b in self.batches:
            rows = np.flatnonzero(b.held == held)
            x[at:at + len(rows)], y[at:at + len(rows)] = b.data.x[rows], b.data.y[rows]
            at += len(rows)
        return Dataset(x, y)

    def _add(self, name: str, start: int, data: Dataset) -> None:
        self.batches.append(_Batch(name, start, data, held_out_mask(name, start, len(data), self.holdout)))
        self.samples += len(data)
        while self.samples > self.window:
            oldest, excess = self.batches[0], self.samples - self.window
            if len(oldest.data) <= excess:
                self.batches.popleft()
                self.samples -= len(oldest.data)
                if self.consume == "delete":
                    self._unlink(oldest.name)
            else:  # keep the newest rows of the oldest file; copies, so the dropped rows are freed
                keep = np.arange(excess, len(oldest.data))
                self.batches[0] = _Batch(oldest.name, oldest.start + excess, oldest.data.subset(keep),
                                         oldest.held[excess:].copy())
                self.samples -= excess

    # -- files ------------------------------------------------------------------------------------
    def _retire(self, name: str) -> None:
        if self.consume == "keep":
            return
        try:
            os.replace(self.dir / name, self.consumed / name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise DataError(f"cannot move {self.dir / name} into {self.consumed} ({exc.strerror}): the agent needs "
                            f"write access to the spool, or set [data] consume = \"keep\"", "permission") from None

    def _reject(self, name: str, reason: str, message: str) -> None:
        self.skipped[reason] += 1
        log.warning("spool skipped a file (%s): %s", reason, message)
        if self.consume == "keep":
            return  # the cursor has passed it
        try:
            self.rejected.mkdir(exist_ok=True)
            os.replace(self.dir / name, self.rejected / name)
        except OSError as exc:
            log.error("spool %s: cannot move %s into %s (%s); it will be skipped again next round",
                      self.dir, name, self.rejected, exc.strerror)

    def _unlink(self, name: str) -> None:
        try:
            (self.consumed / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("spool %s: cannot delete consumed file %s (%s)", self.dir, name, exc.strerror)

    # -- across restarts --------------------------------------------------------------------------
    def _save(self) -> None:
        if self.state_path is None:
            return
        state = {"dir": str(self.dir.resolve()), "consume": self.consume, "cursor_ns": self.cursor_ns,
                 "recent": self.recent, "window": [[b.name, b.start, len(b.data)] for b in self.batches]}
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.state_path, pack(state))
        except OSError as exc:
            log.warning("spool %s: cannot save %s (%s); a restart would start with an empty window",
                        self.dir, self.state_path, exc.strerror)

    def _restore(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            state = unpack(self.state_path.read_bytes())
            if state["dir"] != str(self.dir.resolve()):
                log.info("spool state %s is for %s; starting with an empty window", self.state_path, state["dir"])
                return
            self.cursor_ns, self.recent = int(state["cursor_ns"]), dict(state["recent"])
            window = [(str(name), int(start), int(rows)) for name, start, rows in state["window"]]
        except Exception as exc:  # our own file, but a torn SD card must not stop the agent
            log.error("spool state %s is unreadable (%s); starting with an empty window", self.state_path, exc)
            return
        for name, start, rows in window:
            path = next((p for p in (self.consumed / name, self.dir / name) if p.is_file()), None)
            try:
                if path is None:
                    raise DataError("the file is gone", "missing")
                data = self._fit(read_file(path, self.task, self.label_column, self.shape), path)
            except Exception as exc:
                log.warning("spool %s: window file %s not restored: %s", self.dir, name, exc)
                continue
            self._add(name, start, data.subset(np.arange(start, min(start + rows, len(data)))))
            self.restored.add(name)
