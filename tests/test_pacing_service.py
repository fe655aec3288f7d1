"""`broker-coordinator run` paced, against a real Mosquitto and real agents: a federation whose
served model stops improving rests, `status` says why and what wakes it, and `resume` wakes it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.engine.pacing import read_pace
from broker_coordinator.simulation.private_broker import PrivateBroker
from broker_coordinator.storage.store import Store
from edgefl_protocol import signing
from edgefl_protocol.settings import to_toml

from .fleet import ROOT, Fleet, spawn, write_test_set

FED = "paced"


@pytest.fixture
def broker(tmp_path):
    broker = PrivateBroker(tmp_path / "broker", FED)
    broker.add_user(COORDINATOR_USER)
    for i in range(2):
        broker.add_user(f"dev-{i}")
    with broker:
        yield broker


def rounds_done(state_dir) -> list[int]:
    store = Store(state_dir)
    try:
        return [r["round"] for r in store.rounds() if r["closed"] in ("complete", "deadline")]
    finally:
        store.close()


def command(config, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "broker_coordinator", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    return done.stdout


def test_a_federation_that_stopped_improving_rests_until_the_operator_resumes_it(broker, tmp_path):
    fleet = Fleet(tmp_path, broker, FED, ["dev-0", "dev-1"])
    state_dir = tmp_path / "state"
    config = tmp_path / "coordinator.toml"
    # an improvement of 99 points is never seen: after round 1 sets the best, 2 more rounds rest it
    config.write_text(to_toml({
        "pacing": {"interval": 0, "patience": 2, "min_improvement": 0.99, "new_data": 0},
        "federation": {"name": FED, "model": "digits_mlp",
                       "test_data": str(write_test_set(tmp_path / "test.npz", fleet.test))},
        "broker": {"host": broker.host, "port": broker.port, "username": COORDINATOR_USER,
                   "password": broker.users[COORDINATOR_USER]},
        "schedule": {"min_updates": 2, "round_timeout": 30},
        "algorithm": {"local_epochs": 1},
        "storage": {"state_dir": str(state_dir)},
    }))
    signing.write_key_file(state_dir / "device_keys.toml", fleet.keys)
    service = spawn(["-m", "broker_coordinator", "run", "--config", str(config)], tmp_path / "coordinator.log")
    log = lambda: (tmp_path / "coordinator.log").read_text()  # noqa: E731
    try:
        give_up = time.monotonic() + 180
        while (pace := read_pace(state_dir)) is None or pace.state != "resting":
            assert time.monotonic() < give_up and service.poll() is None, log()
            time.sleep(0.2)
        assert rounds_done(state_dir) == [1, 2, 3]
        assert "the federation rests: the served model has not improved by 0.99 in 2 evaluations" in log()
        shown = command(config, "status")
        assert "resting since" in shown and "in 2 evaluations (best" in shown, shown
        assert "it resumes on `broker-coordinator resume`" in shown, shown

        assert "asked federation 'paced' to resume" in command(config, "resume")
        while max(rounds_done(state_dir), default=0) < 4:
            assert time.monotonic() < give_up and service.poll() is None, log()
            time.sleep(0.2)
        assert "the federation resumes: the operator asked" in log()
        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=60) == 0, log()
        assert "WARNING" not in log() and "ERROR" not in log(), log()
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
        fleet.stop()
