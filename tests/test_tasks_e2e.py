"""Tasks, backups and the previous release's state directories against a real Mosquitto (started as
Debian does, with the project's generated files) and real agent processes, driven by
`broker-coordinator run`, `tasks`, `backup` and `restore` as an operator types them.

Every wait is for a condition: the coordinator runs a given number of rounds and exits, a
checkpoint reaches a round, a process ends. The devices are enrolled the way the enrollment desk
does it (the registry activates the token with the device's own password, the broker's files are
rewritten and Mosquitto reloaded), without the MQTT round trip that tests/test_enrollment.py covers.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from broker_coordinator.access import devices as ops
from broker_coordinator.access.broker import hash_password
from broker_coordinator.access.registry import ACTIVE, Registry
from broker_coordinator.settings.config import load_config
from broker_coordinator.simulation.processes import stop_processes
from broker_coordinator.storage.store import Store, read_checkpoint
from edgefl_protocol.settings import to_toml

from .fleet import spawn
from .operator_fixtures import FEDERATION, PROJECT_ROOT, Server, run_module, start_server, stop_server

DEVICES = ("pi-01", "pi-02", "pi-03")
FEATURES = 60  # logreg60 and synthetic_mlp both take 60 features: the devices' data fits either model


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A learnable 10-class problem: labels from a fixed linear map of Gaussian features."""
    w = np.random.default_rng(1234).normal(size=(FEATURES, 10))
    x = np.random.default_rng(seed).normal(size=(n, FEATURES)).astype(np.float32)
    return x, np.argmax(x @ w, axis=1).astype(np.int64)


@dataclass
class Federation:
    server: Server
    agents: list[subprocess.Popen] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.server.config_path

    @property
    def state(self) -> Path:
        return Path(self.server.config.storage.state_dir)

    def run(self, rounds: int, **env: str) -> subprocess.CompletedProcess:
        """`broker-coordinator run` until it has run its rounds (rounds counts within the task)."""
        done = run_module("broker_coordinator", "run", "--config", str(self.config), timeout=150,
                          env={"EDGEFL_COORDINATOR_FEDERATION_ROUNDS": str(rounds), **env})
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    def start(self, log: Path, **env: str) -> subprocess.Popen:
        """`broker-coordinator run` as a service runs it, in the background (its output to `log`)."""
        with open(log, "wb") as out:
            return subprocess.Popen([sys.executable, "-m", "broker_coordinator", "run", "--config", str(self.config)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT,
                                    env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT), **env})

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return run_module("broker_coordinator", *args, "--config", str(self.config), timeout=60)

    def set_model(self, model: str) -> None:
        text = self.config.read_text()
        before = next(line for line in text.splitlines() if line.startswith("model = "))
        self.config.write_text(text.replace(before, f'model = "{model}"'))

    def active_devices(self) -> dict[str, str]:
        """name -> signing key of every active device in the registry."""
        registry = Registry(self.server.config.registry_path)
        return {d.name: d.signing_key for d in registry.devices() if d.state == ACTIVE}


def start_federation(tmp_path: Path, devices: tuple[str, ...] = DEVICES,
                     start_agent: Callable[[str, Path], subprocess.Popen] | None = None) -> Federation:
    """Mosquitto, a coordinator config (logreg60, FedAvg, one epoch, rounds back to back, every device
    in every round), the devices enrolled and their agents started (`start_agent(device, config)`,
    default this checkout's agent). Stop it with `stop_federation`."""
    server = start_server(tmp_path / "server")
    fed = Federation(server)
    try:
        text = server.config_path.read_text().replace('model = "digits_mlp"', 'model = "logreg60"')
        text = text.replace("[rounds]", f"[rounds]\nlocal_epochs = 1\nmin_updates = {len(devices)}\n"
                                        "clients_per_round = 0")
        server.config_path.write_text(text + "\n[pacing]\ninterval = 0\npatience = 0\n")
        x, y = synthetic(200, seed=0)
        np.savez(server.root / "test.npz", x=x, y=y)
        registry = ops.open_registry(server.config)
        for i, device in enumerate(devices):
            _, token, _ = ops.add_device(server.config, device)
            password = f"{device}-own-password"
            registry.activate(device, token.token_id, hash_password(password))  # what the desk does on enroll
            home = tmp_path / device
            home.mkdir()
            x, y = synthetic(60, seed=10 + i)
            np.savez(home / "data.npz", x=x, y=y)
            (home / "agent.toml").write_text(to_toml({
                "broker": {"host": "127.0.0.1", "port": server.port, "username": device, "password": password},
                "device": {"id": device, "data": str(home / "data.npz"), "state_dir": str(home / "state"),
                           "federation": FEDERATION, "threads": 1, "signing_key": token.signing_key}}))
        ops.apply(server.config, registry)  # the broker's files from the registry, and a reload
        for device in devices:
            home = tmp_path / device
            fed.agents.append(start_agent(device, home / "agent.toml") if start_agent else
                              spawn(["-m", "edge_agent", "run", "--config", str(home / "agent.toml")],
                                    home / "agent.log"))
        return fed
    except BaseException:
        stop_federation(fed)
        raise


def stop_federation(fed: Federation) -> None:
    stop_processes(fed.agents)
    stop_server(fed.server)


@pytest.fixture
def federation(tmp_path) -> Iterator[Federation]:
    fed = start_federation(tmp_path)
    try:
        yield fed
    finally:
        stop_federation(fed)


def trained_rounds(state: Path) -> list[dict]:
    store = Store(state)
    try:
        return [r for r in store.rounds() if r["closed"] in ("complete", "deadline")]
    finally:
        store.close()


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]


def test_a_new_model_starts_a_task_that_the_same_devices_train(federation):
    # the default algorithm keeps a dual on each device: the agents must start it afresh for the new network
    config = federation.server.config_path
    config.write_text(config.read_text().replace('algorithm = "fedavg"', 'algorithm = "dynsam"'))
    first = federation.run(rounds=2)
    assert "finished 2 rounds" in first.stdout, first.stdout + first.stderr
    enrolled = federation.active_devices()

    federation.set_model("synthetic_mlp")
    second = federation.run(rounds=1)
    log = second.stderr
    assert ("INFO broker_coordinator: task 2 starts at round 1 from a fresh model (model logreg60 -> "
            "synthetic_mlp): task 1 (2 rounds, last accuracy") in log, log
    assert "the 3 enrolled devices stay enrolled and train it" in log
    assert "starting at round 1" in second.stdout and "finished 1 rounds" in second.stdout
    assert not warnings_in(log), warnings_in(log)  # a task change alarms nobody

    assert federation.active_devices() == enrolled  # the same devices, the same keys: nobody re-enrolled
    (round_1,) = trained_rounds(federation.state)
    assert (round_1["round"], round_1["task"], round_1["participants"]) == (1, 2, 3)
    # its attempt numbers go on past task 1's for the same round: a device skips a (round, attempt) it ran
    assert round_1["attempt"] == 2
    live = read_checkpoint(federation.state / "checkpoint.msgpack")
    assert live.arch == "synthetic_mlp" and live.round == 1
    assert live.version == 4  # task 1 published versions 0-2; task 2 starts at 3 (its fresh model), round 1 makes 4
    db = sqlite3.connect(federation.state / "coordinator.db")
    accepted = db.execute("SELECT device FROM device_rounds WHERE round = 1 AND accepted = 1").fetchall()
    assert sorted(d for (d,) in accepted) == list(DEVICES)  # each device trained the new model

    archived = federation.state / "tasks" / "1"
    assert [(r["round"], r["participants"]) for r in trained_rounds(archived)] == [(1, 3), (2, 3)]
    assert read_checkpoint(archived / "checkpoint.msgpack").arch == "logreg60"
    assert sorted(p.name for p in (archived / "checkpoints").iterdir()) == ["round-000001.msgpack",
                                                                             "round-000002.msgpack"]

    listing = federation.cli("tasks")
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line.split() for line in listing.stdout.splitlines()[1:] if line[:1].isdigit()}
    assert rows["1"][1:3] == ["archived", "2"] and "logreg60," in rows["1"]
    assert rows["2"][1:3] == ["current", "1"] and "synthetic_mlp," in rows["2"]


def test_a_restore_onto_an_empty_directory_goes_on_at_the_next_round(federation, tmp_path):
    # rounds an hour apart: the coordinator runs round 1, then waits, holding its state, while the backup runs
    config = federation.config
    coordinator = federation.start(tmp_path / "run-1.log", EDGEFL_COORDINATOR_PACING_INTERVAL="1h")
    try:
        give_up = time.monotonic() + 120
        while not (federation.state / "checkpoint.msgpack").exists():  # round 1 is done
            assert time.monotonic() < give_up and coordinator.poll() is None, (tmp_path / "run-1.log").read_text()
            time.sleep(0.2)
        ckpt = read_checkpoint(federation.state / "checkpoint.msgpack")
        saved = federation.cli("backup", str(tmp_path / "backup"))
        assert saved.returncode == 0, saved.stderr
        assert "backed up federation 'field' (task 1 at round 1)" in saved.stdout
    finally:
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=60) == 0, (tmp_path / "run-1.log").read_text()
    assert read_checkpoint(federation.state / "checkpoint.msgpack").round == 1  # nothing after the backup
    enrolled = federation.active_devices()
    # ... until round 2, which the machine runs before it is lost: the devices have run (2, 1)
    assert "finished 2 rounds" in federation.run(rounds=2).stdout

    # a new machine: no state directory, no broker files, no config (Mosquitto keeps running, as the
    # new machine's would once the restored files are in place and it reloads them)
    b = federation.server.config.broker
    for path in (Path(b.passwd_file), Path(b.acl_file), config):
        path.unlink()
    shutil.rmtree(federation.state)
    restored = run_module("broker_coordinator", "restore", str(tmp_path / "backup"), "--config", str(config),
                          "--reload", timeout=60)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert f"the config written to {config}" in restored.stdout

    resumed = federation.run(rounds=2)
    log = resumed.stderr
    assert "starting at round 2" in resumed.stdout and "finished 2 rounds" in resumed.stdout, resumed.stdout
    assert ("INFO broker_coordinator: the devices ran rounds up to 2, which this state directory never saw "
            "(restored from an earlier backup?): rounds 2-2 start at attempt 2") in log, log
    # the engine's own word on the lost round's model version, which the broker still holds (its to say)
    assert all("is retained on the broker from an earlier run" in line for line in warnings_in(log)), log
    assert federation.active_devices() == enrolled
    round_1, round_2 = trained_rounds(federation.state)
    assert (round_2["round"], round_2["attempt"], round_2["participants"]) == (2, 2, 3)
    assert round_2["base_sha256"] == ckpt.sha256 == round_1["model_sha256"]


def test_a_state_directory_of_the_previous_release_keeps_its_devices_and_resumes(federation):
    """Release 0.1's layout is this store's without a task index: one round run by the engine on a
    bare `Store` writes one, the devices in its registry."""
    from broker_coordinator.engine.loop import Engine
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_models.datasets import load_npz

    config = load_config(federation.config)
    registry = Registry(config.registry_path)
    engine = Engine(FEDERATION, "logreg60", load_npz(config.federation.test_data), RoundSettings(
        algorithm="fedavg", local_epochs=1, min_updates=3, round_timeout=30), store=Store(federation.state),
        device_keys=registry.signing_keys(FEDERATION))
    try:
        engine.connect(config.broker.host, config.broker.port, config.broker.username, config.broker.password)
        engine.wait_for_devices(3, 120)
        assert engine.run_round(1).participants == 3
    finally:
        engine.close()
    db = sqlite3.connect(federation.state / "coordinator.db")
    assert not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'tasks'").fetchone()  # release 0.1's layout
    enrolled = federation.active_devices()

    resumed = federation.run(rounds=2)
    log = resumed.stderr
    assert (f"state directory {federation.state} of release 0.1: its rounds and checkpoints are task 1 "
            "(model logreg60, classification (cross_entropy), fedavg, test data") in log, log
    assert "resumed from the checkpoint of round 1" in log and "starting at round 2" in resumed.stdout
    assert not warnings_in(log), warnings_in(log)
    assert federation.active_devices() == enrolled
    rounds = trained_rounds(federation.state)
    assert [(r["round"], r["task"], r["participants"]) for r in rounds] == [(1, 1, 3), (2, 1, 3)]
    assert rounds[1]["base_sha256"] == rounds[0]["model_sha256"]
    listing = federation.cli("tasks")
    assert [line.split()[:3] for line in listing.stdout.splitlines()[1:] if line[:1].isdigit()] == \
        [["1", "current", "2"]], listing.stdout


def test_a_device_revoked_while_a_round_waits_for_it_leaves_the_round_at_once(federation, tmp_path):
    """pi-03's agent hangs (SIGSTOP) after round 1; round 2 would wait two minutes for it. `devices
    revoke pi-03` while round 2 collects: the coordinator sees its status cleared, asks the registry,
    and closes the round with the other two devices' updates instead of waiting for the deadline."""
    federation.run(rounds=1)
    hung = federation.agents[DEVICES.index("pi-03")]
    hung.send_signal(signal.SIGSTOP)
    log = tmp_path / "coordinator.log"
    service = federation.start(log, EDGEFL_COORDINATOR_FEDERATION_ROUNDS="2", EDGEFL_COORDINATOR_SCHEDULE_MIN_UPDATES="2",
                               EDGEFL_COORDINATOR_SCHEDULE_ROUND_TIMEOUT="120")
    try:
        give_up = time.monotonic() + 60
        while Store(federation.state).last_attempt(2) < 1:  # round 2 is open and waits for pi-03
            assert time.monotonic() < give_up and service.poll() is None, log.read_text()
            time.sleep(0.2)
        revoked = federation.cli("devices", "revoke", "pi-03")
        assert revoked.returncode == 0, revoked.stderr
        assert service.wait(timeout=60) == 0, log.read_text()  # long before round 2's 120 s deadline
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
        hung.send_signal(signal.SIGCONT)
    text = log.read_text()
    assert "pi-03 left the round: revoked" in text, text
    (_, second) = trained_rounds(federation.state)
    assert (second["round"], second["closed"], second["participants"]) == (2, "complete", 2), second


def serving_version(device: str, root: Path) -> int | None:
    """The version a device's serving store makes current (None before its first)."""
    try:
        return int(os.readlink(root / device / "state" / "serving" / "current"))
    except (OSError, ValueError):
        return None


def test_a_revoked_device_stops_receiving_serving_releases(federation, tmp_path):
    """Round 1's serving release reaches all three devices; pi-03 is revoked; round 2's release
    reaches pi-01 and pi-02, and pi-03, refused by the broker, keeps serving version 1."""
    federation.run(rounds=1)
    give_up = time.monotonic() + 60
    while not all(serving_version(d, tmp_path) == 1 for d in DEVICES):
        assert time.monotonic() < give_up, {d: serving_version(d, tmp_path) for d in DEVICES}
        time.sleep(0.2)
    revoked = federation.cli("devices", "revoke", "pi-03")
    assert revoked.returncode == 0, revoked.stderr
    pi03_log = tmp_path / "pi-03" / "agent.log"
    while "not authorized" not in pi03_log.read_text().lower():  # the broker has closed its session
        assert time.monotonic() < give_up + 60, pi03_log.read_text()[-2000:]
        time.sleep(0.2)
    federation.run(rounds=2, EDGEFL_COORDINATOR_SCHEDULE_MIN_UPDATES="2",
                   EDGEFL_COORDINATOR_SERVING_ONLY_BETTER="false")
    while not all(serving_version(d, tmp_path) == 2 for d in ("pi-01", "pi-02")):
        assert time.monotonic() < give_up + 120, {d: serving_version(d, tmp_path) for d in DEVICES}
        time.sleep(0.2)
    assert serving_version("pi-03", tmp_path) == 1
    assert "serving: published 2" not in pi03_log.read_text()
