"""`broker-coordinator tasks`, `backup DIR` and `restore DIR`: the state directory as the operator
sees it (storage/tasks.py, storage/backup.py, storage/restore.py do the work). None imports torch."""

from __future__ import annotations

import time
from pathlib import Path

from broker_coordinator.settings.config import CoordinatorConfig
from broker_coordinator.storage.backup import SECRET_ENV, backup
from broker_coordinator.storage.restore import restore
from broker_coordinator.storage.tasks import ARCHIVE, Task, read_tasks


def tasks(config: CoordinatorConfig) -> int:
    state = config.storage.state_dir
    found = read_tasks(state)
    if not found:
        print(f"no task yet in {state}: 'broker-coordinator run' starts the first")
        return 0
    rows = [("TASK", "STATE", "ROUNDS", "LAST SCORE", "STARTED", "ENDED", "DEFINITION")]
    rows += [(str(t.id), "current" if t.current else "archived", str(t.last_round or 0), _score(t),
              _when(t.started_at), _when(t.ended_at), t.definition.describe() + (f" ({t.note})" if t.note else ""))
             for t in found]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    if any(not t.current for t in found):
        print(f"an archived task's rounds and checkpoints are in {state}/{ARCHIVE}/<TASK>/")
    return 0


def back_up(config: CoordinatorConfig, target: Path) -> int:
    manifest = backup(config, target)
    where = f"task {manifest.task} at round {manifest.round or 0}" if manifest.task else "no task yet"
    archived = sum(1 for e in manifest.files if e.role == "state" and e.name.startswith(f"{ARCHIVE}/")
                   and e.name.endswith("/coordinator.db"))
    print(f"backed up federation {manifest.federation!r} ({where}) to {target}: {len(manifest.files)} files, "
          f"{manifest.total_bytes / 1e6:.1f} MB (the device registry, {archived} archived task(s), the checkpoints, "
          f"the broker's files, the config); manifest {Path(target) / 'manifest.json'}")
    for missing in manifest.missing:
        print(f"note: not backed up, it does not exist: [broker] {missing}")
    if manifest.secret_in_environment:
        print(f"note: ${SECRET_ENV} is set here: if the service takes [broker] password from the environment, "
              "no file holds it; keep it with the backup")
    return 0


def restore_from(source: Path, config_path: Path, force: bool, reload: bool) -> int:
    done = restore(source, config_path, force)
    m, config = done.manifest, done.config
    print(f"restored federation {m.federation!r} (task {m.task} at round {m.round or 0}, backed up "
          f"{_when(m.created_at)}) into {config.storage.state_dir}: {len(done.placed)} files"
          + (f", the config written to {config_path}" if done.wrote_config else f", with the config {config_path}"))
    for skipped in done.skipped:
        print(f"note: not restored, {config_path} names no place for it: {skipped}")
    if m.secret_in_environment:
        print(f"note: the backed-up coordinator took ${SECRET_ENV} from its environment: set it here too")
    if reload:
        from broker_coordinator.access.devices import reload_broker
        print(reload_broker(config.broker))
        print("next: start the coordinator (sudo systemctl start broker-coordinator)")
    else:
        print("next: reload Mosquitto (sudo systemctl reload mosquitto) for the restored password and ACL files, "
              "then start the coordinator (sudo systemctl start broker-coordinator)")
    return 0


def _score(task: Task) -> str:
    return f"{task.metric} {task.last_score:.4g}" if task.last_score is not None else "-"


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at)) if at else "-"
