"""`broker-coordinator restore DIR`: a backup (storage/backup.py) back into place, on this machine or
a new one, with the coordinator stopped.

Every file's sha256 is checked before anything is written. The config is the one at `--config` when
it exists (its paths say where the state directory and the broker's files go on this machine), else
the backup's, written there. The state directory must be empty (its lock aside) unless `--force`,
which first empties it; a running coordinator holds its lock, so a restore under it is refused.
Files go in as they were backed up: mode, and, for root, owner and group when this machine knows
them (else the owner of the directory they land in, as the coordinator's own files are).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from broker_coordinator.settings.config import CoordinatorConfig, load_config
from broker_coordinator.storage.backup import BackupError, Entry, Manifest, read_manifest
from broker_coordinator.storage.statelock import StateLock

LOCK = "coordinator.lock"  # storage/statelock.py


@dataclass
class Restored:
    manifest: Manifest
    config: CoordinatorConfig
    wrote_config: bool  # the backup's config was written to --config (there was none)
    placed: list[Path]
    skipped: list[str]  # backed-up files this machine's config has no place for


def restore(source: Path | str, config_path: Path, force: bool = False) -> Restored:
    source = Path(source)
    manifest = read_manifest(source)  # every hash, before anything is written
    backed_up = next((e for e in manifest.files if e.role == "config"), None)
    if backed_up is None:
        raise BackupError(f"backup {source} holds no coordinator config; nothing was restored")
    wrote_config = not config_path.exists()
    config = load_config(source / backed_up.path if wrote_config else config_path, with_rounds=False)
    if config.federation.name != manifest.federation:
        raise BackupError(f"backup {source} is of federation {manifest.federation!r}, {config_path} is for "
                          f"{config.federation.name!r}: restore with the backup's config (--config a path "
                          "that does not exist yet)")
    state = Path(config.storage.state_dir)
    database = next((e for e in manifest.files if e.role == "state" and e.name == "coordinator.db"), None)
    _make_dirs(state, _owner(database, state.parent) if database else None)
    with StateLock(state).acquire("restore") as lock:
        if os.geteuid() == 0:  # the coordinator's service user opens the lock too
            os.chown(lock.path, *_owner(None, state))
        held = sorted(p.name for p in state.iterdir() if p.name != LOCK)
        if held and not force:
            raise BackupError(f"state directory {state} is not empty ({', '.join(held[:4])}"
                              f"{', ...' if len(held) > 4 else ''}): restore onto an empty directory, or add "
                              "--force to replace what it holds")
        for name in held:
            _remove(state / name)
        if wrote_config:
            _place(source / backed_up.path, config_path, backed_up)
            config = load_config(config_path, with_rounds=False)
        placed, skipped = [config_path] if wrote_config else [], []
        for entry in manifest.files:
            target = _target(entry, config, state)
            if target is None:
                if entry.role != "config":
                    skipped.append(f"{entry.role} {entry.path}")
                continue
            if entry.role == "state":  # its folders (checkpoints/, tasks/<id>/) the coordinator's own
                _make_dirs(target.parent, _owner(None, state))
            _place(source / entry.path, target, entry)
            placed.append(target)
    return Restored(manifest, config, wrote_config, placed, skipped)


def _target(entry: Entry, config: CoordinatorConfig, state: Path) -> Path | None:
    """Where `entry` goes on this machine (None: the config has no place for it)."""
    if entry.role == "state":
        return state / entry.name
    if entry.role == "config":
        return None  # the config is written first, or kept
    value = getattr(config.broker, entry.role, "")
    return Path(value) if value else None


def _place(source: Path, target: Path, entry: Entry) -> None:
    """Copy `source` to `target` as it was backed up (mode, owner), fsynced, by rename."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            os.fchmod(out.fileno(), entry.mode)
            if os.geteuid() == 0:
                os.fchown(out.fileno(), *_owner(entry, target.parent))
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    for stale in (f"{target}-wal", f"{target}-shm"):  # never beside a database they do not belong to
        Path(stale).unlink(missing_ok=True)
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _owner(entry: Entry | None, directory: Path) -> tuple[int, int]:
    """The backed-up owner and group when this machine has them, else those of `directory`."""
    try:
        if entry is not None:
            return pwd.getpwnam(entry.owner).pw_uid, grp.getgrnam(entry.group).gr_gid
    except KeyError:
        pass
    info = directory.stat()
    return info.st_uid, info.st_gid


def _make_dirs(path: Path, owner: tuple[int, int] | None) -> None:
    """`path` and its missing parents (mode 0700), owned by `owner` when run as root."""
    if path.exists():
        return
    _make_dirs(path.parent, owner)
    path.mkdir(mode=0o700)
    if owner is not None and os.geteuid() == 0:
        os.chown(path, *owner)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
