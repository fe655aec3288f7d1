"""`broker-coordinator backup DIR`: what a new machine needs to go on with the same federation and
the same devices, taken while the coordinator runs.

    DIR/state/          the state directory: coordinator.db (the device registry, the task index, the
                        current task's rounds) and each archived task's database, copied with SQLite's
                        online backup (a consistent copy while the coordinator writes, its WAL included);
                        then the checkpoints, pacing.json and device_keys.toml (devices provisioned by hand)
    DIR/broker/         Mosquitto's password and ACL files, the conf.d fragment, the TLS certificate, key
                        and CA when configured (the devices' tokens pin the CA's fingerprint)
    DIR/config/         the coordinator's config: its [broker] password is the secret the admin, enrollment
                        and site passwords and the site keys derive from
    DIR/manifest.json   written last: format, EdgeFL version, federation, task, round, and per file its
                        role, size, sha256, mode and owner (`restore` checks every hash before it writes)

Order: the databases before the checkpoints, so that a checkpoint is never older than the rounds in
the database (a restored coordinator takes the checkpoint as the truth and fills in a round the
database lacks; the other way round a round would be recorded twice), and the current task's files
before the archived tasks' (a task switch under way moves them into tasks/: storage/tasks.py).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgefl_protocol.persist import file_sha256

from broker_coordinator.settings.config import ENV_PREFIX, CoordinatorConfig
from broker_coordinator.storage.store import CHECKPOINT, HISTORY_DIR, StoreError
from broker_coordinator.storage.tasks import ARCHIVE, DATABASE, read_tasks

FORMAT = 1
MANIFEST = "manifest.json"
# the state directory's files a backup holds, besides the databases (the lock, WAL files, temp files
# and what the operator keeps there, such as tracking runs, are not state)
STATE_FILES = (CHECKPOINT, HISTORY_DIR, "pacing.json", "device_keys.toml")
BROKER_ROLES = ("passwd_file", "acl_file", "conf_file", "tls_cert", "tls_key", "tls_ca")  # [broker] keys
SECRET_ENV = f"{ENV_PREFIX}_BROKER_PASSWORD"


class BackupError(StoreError):
    """A backup or restore that cannot be done; the message says what to do."""


@dataclass
class Entry:
    path: str  # in the backup, e.g. "state/coordinator.db"
    role: str  # "state" (name is relative to the state directory), "config", or a [broker] key
    name: str
    bytes: int
    sha256: str
    mode: int
    owner: str
    group: str


@dataclass
class Manifest:
    federation: str
    edgefl: str
    created_at: float
    task: int | None
    round: int | None
    secret_in_environment: bool  # [broker] password came from the environment: not in the config copy
    files: list[Entry] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # broker files the config names that did not exist
    format: int = FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.files)


def backup(config: CoordinatorConfig, target: Path | str) -> Manifest:
    """Copy what `restore` needs into `target` (absent or empty), the manifest last."""
    target, state = Path(target), Path(config.storage.state_dir)
    if not (state / DATABASE).exists():
        raise BackupError(f"no {DATABASE} in {state} ([storage] state_dir): nothing to back up")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise BackupError(f"{target} is not an empty directory: give a new one for each backup")
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(target, 0o700)  # it holds the registry's signing keys and the coordinator's secret
    tasks = read_tasks(state)
    current = next((t for t in tasks if t.current), None)
    manifest = Manifest(config.federation.name, _version(), time.time(), current.id if current else None,
                        current.last_round if current else None, SECRET_ENV in os.environ)

    def add(source: Path, role: str, name: str, path: str, copy: Callable[[Path, Path], None] = _copy_file) -> None:
        entry = _entry(source, target / path, role, name, path, copy)
        if entry is not None:
            manifest.files.append(entry)

    def add_state(source: Path) -> None:
        relative = source.relative_to(state).as_posix()
        add(source, "state", relative, f"state/{relative}", _copy_database if source.name == DATABASE else _copy_file)

    add_state(state / DATABASE)
    for name in STATE_FILES:
        for source in _files(state / name):
            add_state(source)
    archive = state / ARCHIVE
    for task_dir in sorted(p for p in archive.iterdir() if not p.name.startswith(".")) if archive.is_dir() else []:
        for source in sorted(_files(task_dir), key=lambda p: p.name != DATABASE):  # its database first
            add_state(source)
    add(config.path, "config", config.path.name, f"config/{config.path.name}")
    for role in BROKER_ROLES:
        value = getattr(config.broker, role)
        if not value:
            continue
        if not Path(value).exists() and not role.startswith("tls_"):  # TLS files configured must be there
            manifest.missing.append(f"{role} {value}")
            continue
        name = Path(value).name
        path = f"{'broker/tls' if role.startswith('tls_') else 'broker'}/{name}"
        if any(e.path == path for e in manifest.files):  # two of the broker's files by one name
            path = f"{path.rsplit('/', 1)[0]}/{role}-{name}"
        add(Path(value), role, name, path)
    (target / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1) + "\n")
    os.chmod(target / MANIFEST, 0o600)
    return manifest


def read_manifest(source: Path | str) -> Manifest:
    """The backup's manifest, with every file's size and sha256 checked against it."""
    source = Path(source)
    try:
        raw = json.loads((source / MANIFEST).read_text())
    except FileNotFoundError:
        raise BackupError(f"{source} holds no {MANIFEST}: not a complete backup (the manifest is written "
                          "last)") from None
    except (OSError, ValueError) as exc:
        raise BackupError(f"cannot read {source / MANIFEST}: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format", 0) > FORMAT:
        raise BackupError(f"{source} was made by a newer EdgeFL ({raw.get('edgefl', '?')}, backup format "
                          f"{raw.get('format')}): restore it with that version or a newer one")
    try:
        manifest = Manifest(**{**raw, "files": [Entry(**e) for e in raw["files"]]})
    except (KeyError, TypeError) as exc:
        raise BackupError(f"{source / MANIFEST} is not a backup manifest ({exc})") from None
    for entry in manifest.files:
        if any(Path(name).is_absolute() or ".." in Path(name).parts for name in (entry.path, entry.name)):
            raise BackupError(f"{source / MANIFEST} names a file outside the backup or the state directory "
                              f"({entry.path}): not a backup this command wrote")
        path = source / entry.path
        if not path.is_file() or path.stat().st_size != entry.bytes or file_sha256(path) != entry.sha256:
            what = "is missing" if not path.is_file() else "differs from the manifest"
            raise BackupError(f"backup {source} is damaged: {entry.path} {what}; nothing was restored: "
                              "use another backup")
    return manifest


def _entry(source: Path, copy_to: Path, role: str, name: str, path: str,
           copy: Callable[[Path, Path], None]) -> Entry | None:
    """Copy `source` (None if it vanished meanwhile: a checkpoint the coordinator pruned)."""
    copy_to.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        info = source.stat()
        copy(source, copy_to)
    except FileNotFoundError:
        if role == "state" and name != DATABASE:
            return None
        raise BackupError(f"{source} ({role}) does not exist: check the config, or create it first") from None
    except PermissionError:
        raise BackupError(f"cannot read {source}: run as root (sudo) or as the coordinator's service "
                          "user") from None
    return Entry(path, role, name, copy_to.stat().st_size, file_sha256(copy_to), info.st_mode & 0o777,
                 _name(pwd.getpwuid, info.st_uid), _name(grp.getgrgid, info.st_gid))


def _copy_database(source: Path, target: Path) -> None:
    """SQLite's online backup: one consistent snapshot, while the coordinator goes on writing."""
    if not source.exists():
        raise FileNotFoundError(source)
    live = sqlite3.connect(source, timeout=30)  # reads only (read-only WAL connections need the -shm file)
    copy = sqlite3.connect(target)
    try:
        live.backup(copy)
        copy.execute("PRAGMA journal_mode=DELETE")  # one self-contained file (a store turns WAL on again)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot copy {source}: {exc} (run as root, sudo, or as the coordinator's service "
                          "user)") from None
    finally:
        copy.close()
        live.close()


def _copy_file(source: Path, target: Path) -> None:
    with open(source, "rb") as src, open(target, "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
        dst.flush()
        os.fsync(dst.fileno())


def _files(path: Path) -> list[Path]:
    """`path`, or the files under it, without temp files (a write under way) and dot files."""
    found = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    return [p for p in found if not p.name.startswith(".") and not p.name.endswith((".tmp", "-wal", "-shm"))]


def _name(lookup, number: int) -> str:  # noqa: ANN001 - pwd.getpwuid or grp.getgrgid
    try:
        return lookup(number)[0]
    except KeyError:
        return str(number)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgefl")
    except PackageNotFoundError:
        return "unknown"
