"""`broker-coordinator backup` and `restore` without a broker: what a backup holds (rows still in
the WAL of a coordinator that is writing included), and what `restore` refuses, in one line each,
before it writes anything. The round trip with a broker and agents is tests/test_tasks_e2e.py's."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from broker_coordinator.access.registry import Registry
from broker_coordinator.cli.cli import main
from broker_coordinator.storage.statelock import StateLock
from broker_coordinator.storage.store import Checkpoint, Store, model_sha256
from edgefl_protocol.settings import to_toml


@pytest.fixture
def config(tmp_path) -> Path:
    """A coordinator's config, state directory (a device, a round, an archived task) and broker files."""
    broker = tmp_path / "mosquitto"
    broker.mkdir()
    (broker / "passwd").write_text("pi-01:$7$hash\n")
    (broker / "acl").write_text("pattern read edgefl/f/device/%u/task\n")
    path = tmp_path / "coordinator.toml"
    path.write_text(to_toml({
        "federation": {"name": "f", "model": "logreg60"},
        "broker": {"password": "the-secret", "passwd_file": str(broker / "passwd"), "acl_file": str(broker / "acl"),
                   "conf_file": str(broker / "edgefl.conf")},
        "storage": {"state_dir": str(tmp_path / "state")}}))
    state = tmp_path / "state"
    Registry(state / "coordinator.db").add("pi-01", "f", "$7$hash", "11" * 32, "token", 4e9)
    (state / "tasks" / "1").mkdir(parents=True)
    Store(state / "tasks" / "1").close()
    weights = {"w": np.ones(3, np.float32)}
    store = Store(state)
    store.save_checkpoint(Checkpoint(1, 1, "logreg60", weights, model_sha256(weights), {}, {}))
    store.close()
    return path


def cli(*args: str, capsys) -> tuple[int, str, str]:  # noqa: ANN001
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_backup_taken_while_the_coordinator_writes_holds_its_rows(config, tmp_path, capsys):
    store = Store(tmp_path / "state")  # a running coordinator: its rows are in the WAL, not yet in the file
    store.db.execute("PRAGMA wal_autocheckpoint = 0")
    store.start_attempt(2, 1)
    assert (tmp_path / "state" / "coordinator.db-wal").stat().st_size > 0
    code, out, err = cli("backup", str(tmp_path / "backup"), "--config", str(config), capsys=capsys)
    store.close()
    assert code == 0, err
    assert out.startswith("backed up federation 'f' (no task yet) to ") and "1 archived task(s)" in out
    assert "note: not backed up, it does not exist: [broker] conf_file" in out

    backup = tmp_path / "backup"
    manifest = json.loads((backup / "manifest.json").read_text())
    assert oct(backup.stat().st_mode & 0o777) == "0o700" and manifest["format"] == 1
    paths = {e["path"]: e for e in manifest["files"]}
    assert set(paths) == {"state/coordinator.db", "state/checkpoint.msgpack", "state/checkpoints/round-000001.msgpack",
                          "state/tasks/1/coordinator.db", "config/coordinator.toml", "broker/passwd", "broker/acl"}
    assert paths["broker/passwd"]["role"] == "passwd_file" and paths["state/checkpoint.msgpack"]["mode"] == 0o600
    copy = sqlite3.connect(backup / "state" / "coordinator.db")
    assert copy.execute("SELECT round, attempt FROM attempts").fetchall() == [(2, 1)]  # from the WAL
    assert copy.execute("SELECT signing_key FROM devices").fetchall() == [("11" * 32,)]
    assert not list(backup.rglob("*-wal"))  # each database one self-contained file

    code, _, err = cli("backup", str(tmp_path / "backup"), "--config", str(config), capsys=capsys)
    assert code == 2 and "is not an empty directory: give a new one for each backup" in err


@pytest.fixture
def backup(config, tmp_path, capsys) -> Path:
    assert cli("backup", str(tmp_path / "backup"), "--config", str(config), capsys=capsys)[0] == 0
    return tmp_path / "backup"


def test_restore_refuses_in_one_line_and_writes_nothing(config, backup, tmp_path, capsys):
    state = tmp_path / "state"
    code, _, err = cli("restore", str(backup), "--config", str(config), capsys=capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"state directory {state} is not empty (checkpoint.msgpack, checkpoints, coordinator.db, tasks)" in err
    assert "add --force to replace what it holds" in err

    with StateLock(state).acquire("run"):  # a coordinator running on it
        code, _, err = cli("restore", str(backup), "--config", str(config), "--force", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "cannot restore: a coordinator (pid" in err

    elsewhere = tmp_path / "other.toml"
    elsewhere.write_text(config.read_text().replace('name = "f"', 'name = "g"'))
    code, _, err = cli("restore", str(backup), "--config", str(elsewhere), capsys=capsys)
    assert code == 2 and "backup" in err and "is of federation 'f'" in err and "is for 'g'" in err

    checkpoint = backup / "state" / "checkpoint.msgpack"
    checkpoint.write_bytes(checkpoint.read_bytes()[:-1] + b"x")
    fresh = tmp_path / "new" / "coordinator.toml"
    code, _, err = cli("restore", str(backup), "--config", str(fresh), capsys=capsys)
    assert code == 2 and err.count("\n") == 1
    assert "state/checkpoint.msgpack differs from the manifest; nothing was restored: use another backup" in err
    assert not fresh.exists()

    (backup / "manifest.json").unlink()
    code, _, err = cli("restore", str(backup), "--config", str(fresh), capsys=capsys)
    assert code == 2 and "holds no manifest.json: not a complete backup" in err


def test_restore_onto_a_new_machine_and_with_force(config, backup, tmp_path, capsys):
    state = tmp_path / "state"
    for path in (config, tmp_path / "mosquitto" / "passwd", tmp_path / "mosquitto" / "acl"):
        path.unlink()
    original = (backup / "config" / "coordinator.toml").read_text()
    (state / "coordinator.db").rename(tmp_path / "old.db")
    for name in ("checkpoint.msgpack", "checkpoints", "tasks"):
        (state / name).rename(tmp_path / name)  # the new machine's state directory: empty (a lock file aside)
    (state / "coordinator.db-wal").write_bytes(b"")  # nothing of the old database may stay beside the new one

    code, out, err = cli("restore", str(backup), "--config", str(config), capsys=capsys)
    assert code == 2 and "not empty (coordinator.db-wal)" in err
    code, out, err = cli("restore", str(backup), "--config", str(config), "--force", capsys=capsys)
    assert code == 0, err
    assert f"the config written to {config}" in out and "next: reload Mosquitto" in out
    assert config.read_text() == original
    assert (tmp_path / "mosquitto" / "passwd").read_text() == "pi-01:$7$hash\n"
    assert not (state / "coordinator.db-wal").exists()
    assert Registry(state / "coordinator.db").require("pi-01").signing_key == "11" * 32
    assert Store(state).load_checkpoint().round == 1 and (state / "tasks" / "1" / "coordinator.db").exists()
    assert oct((state / "checkpoint.msgpack").stat().st_mode & 0o777) == "0o600"


def test_tasks_backup_and_restore_start_without_torch(config, tmp_path):
    """Like the device-management commands (tests/test_operator_guide.py): quick on a small server."""
    probe = ("import sys\nfrom broker_coordinator.cli.cli import main\n"
             "main(['tasks', '--config', sys.argv[1]])\n"
             "main(['backup', sys.argv[2], '--config', sys.argv[1]])\n"
             "main(['restore', sys.argv[2], '--config', sys.argv[1], '--force'])\n"
             "print('torch' in sys.modules)\n")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", probe, str(config), str(tmp_path / "backup")], capture_output=True,
                          text=True, timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.stdout.strip().splitlines()[-1:] == ["False"], done.stdout + done.stderr
    assert "restored federation 'f'" in done.stdout
