"""Runtime services against a real Mosquitto and real agent processes:
deadlines and quorum, presence, late updates, broker restarts, coordinator crashes."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from broker_coordinator.access.broker import COORDINATOR_USER, free_port
from broker_coordinator.simulation.private_broker import PrivateBroker
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.engine.rounds import RoundState
from broker_coordinator.storage.store import Store
from edgefl_protocol import codec, messages, signing, topics
from edgefl_protocol.settings import to_toml
from edgefl_protocol.transport import connect, make_client
from edgefl_models.architectures import build_model, get_weights

from .fleet import Fleet, spawn, write_test_set

FED = "rt"


@pytest.fixture
def fleet_broker(tmp_path):
    broker = PrivateBroker(tmp_path / "broker", FED)
    broker.add_user(COORDINATOR_USER)
    for i in range(3):
        broker.add_user(f"dev-{i}")
    with broker:
        yield broker


def make_coordinator(broker, fleet, tmp_path, on_state=None, **settings) -> Engine:
    coordinator = Engine(FED, "digits_mlp", fleet.test, RoundSettings(local_epochs=1, **settings),
                              store=Store(tmp_path / "coordinator"), on_state=on_state, device_keys=fleet.keys)
    coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
    return coordinator


def test_killed_agent_round_closes_at_deadline_and_offline_device_is_not_selected(fleet_broker, tmp_path, caplog):
    fleet = Fleet(tmp_path, fleet_broker, FED, ["dev-0", "dev-1", "dev-2"])

    def kill_dev0_when_round_2_opens(rnd):
        if rnd.number == 2 and rnd.state == RoundState.OPEN and "dev-0" in rnd.cohort:
            fleet.kill("dev-0")

    coordinator = make_coordinator(fleet_broker, fleet, tmp_path, kill_dev0_when_round_2_opens,
                                   min_updates=2, round_timeout=8)
    try:
        coordinator.wait_for_devices(3, 120)
        first = coordinator.run_round(1)
        assert (first.closed, first.participants) == ("complete", 3)

        second = coordinator.run_round(2)  # dev-0 dies before it can answer
        assert (second.closed, second.participants, second.selected) == ("deadline", 2, 3)
        assert second.accuracy >= 0 and coordinator.version == 2

        third = coordinator.run_round(3)  # dev-0 is offline (its will said so): not selected
        assert (third.closed, third.selected) == ("complete", 2)
        assert "dev-0" not in third.devices

        # a late update for round 2 (which dev-0 never answered) from dev-0's credentials: rejected with its
        # reason (a second update for round 1, which dev-0 did answer, would be a replay)
        late = make_client("dev-0-late", "dev-0", fleet_broker.users["dev-0"])
        connect(late, fleet_broker.host, fleet_broker.port)
        zero = {k: np.zeros_like(v) for k, v in get_weights(build_model("digits_mlp")).items()}
        encoded = codec.encode(zero, coordinator.settings.codec)
        update = messages.Update("dev-0", 2, 1, 10, {"steps": 1}, encoded.body, encoded.codec, encoded.specs, FED)
        late.publish(topics.update(FED, "dev-0"), messages.encode_update(update, fleet.keys["dev-0"]),
                     qos=1).wait_for_publish(5)
        late.disconnect()
        late.loop_stop()
        with caplog.at_level(logging.INFO, logger="broker_coordinator"):  # a late update is routine: INFO
            give_up = time.monotonic() + 10
            while coordinator.intake.rejections["late"] == 0 and time.monotonic() < give_up:
                coordinator.drain(0.2)
        assert coordinator.intake.rejections["late"] == 1
        assert "update from dev-0 rejected: late: round 2 closed at" in caplog.text
    finally:
        coordinator.close()
        fleet.stop()


def test_broker_restart_mid_round_and_training_continues(fleet_broker, tmp_path):
    fleet = Fleet(tmp_path, fleet_broker, FED, ["dev-0", "dev-1"])

    def restart_broker_in_round_2(rnd):
        if rnd.number == 2 and rnd.state == RoundState.COLLECTING:
            fleet_broker.stop()
            time.sleep(0.5)
            fleet_broker.start()

    coordinator = make_coordinator(fleet_broker, fleet, tmp_path, restart_broker_in_round_2,
                                   min_updates=1, round_timeout=30)
    try:
        coordinator.wait_for_devices(2, 120)
        records = [coordinator.run_round(r) for r in (1, 2, 3)]
        coordinator.wait_for_devices(2, 120)  # both agents back online after the broker's restart (their backoff)
        records.append(coordinator.run_round(4))
        assert [r.closed != "abandoned" for r in records] == [True] * 4
        assert coordinator.version == 4
        assert coordinator.transport.session.reconnects >= 1
        logs = {d: path.read_text()[-1500:] for d, path in fleet.logs.items()}
        assert records[-1].participants == 2, (coordinator.presence.online, coordinator.presence.pending_until, logs)  # both came back
    finally:
        coordinator.close()
        fleet.stop()


def test_coordinator_sigkill_resumes_from_checkpoint(fleet_broker, tmp_path):
    fleet = Fleet(tmp_path, fleet_broker, FED, ["dev-0", "dev-1"])
    state_dir = tmp_path / "coordinator-state"
    config = tmp_path / "coordinator.toml"
    config.write_text(to_toml({
        "pacing": {"interval": 0, "patience": 0},  # rounds back to back, as a test wants
        "federation": {"name": FED, "model": "digits_mlp", "rounds": 6,
                       "test_data": str(write_test_set(tmp_path / "test.npz", fleet.test))},
        "broker": {"host": fleet_broker.host, "port": fleet_broker.port, "username": COORDINATOR_USER,
                   "password": fleet_broker.users[COORDINATOR_USER]},
        "rounds": {"local_epochs": 1, "min_updates": 2, "round_timeout": 30},
        "storage": {"state_dir": str(state_dir)},
    }))
    signing.write_key_file(state_dir / "device_keys.toml", fleet.keys)
    run = ["-m", "broker_coordinator", "run", "--config", str(config)]
    try:
        first = spawn(run, tmp_path / "coordinator-1.log")
        give_up = time.monotonic() + 120
        while not (state_dir / "checkpoint.msgpack").exists() or Store(state_dir).load_checkpoint().round < 2:
            assert time.monotonic() < give_up and first.poll() is None, (tmp_path / "coordinator-1.log").read_text()
            time.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait()
        killed_at = Store(state_dir).load_checkpoint()
        assert killed_at.round < 6

        second = spawn(run, tmp_path / "coordinator-2.log")
        assert second.wait(timeout=180) == 0, (tmp_path / "coordinator-2.log").read_text()
        log = (tmp_path / "coordinator-2.log").read_text()
        assert f"resumed from the checkpoint of round {killed_at.round}" in log

        rounds = [r for r in Store(state_dir).rounds() if r["closed"] in ("complete", "deadline")]
        assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5, 6]  # none twice, none missing
        resumed = rounds[killed_at.round]  # the first round the second process ran
        assert resumed["base_sha256"] == killed_at.sha256
        for before, after in zip(rounds, rounds[1:]):
            assert after["base_sha256"] == before["model_sha256"]
    finally:
        for p in ("first", "second"):
            proc = locals().get(p)
            if isinstance(proc, subprocess.Popen) and proc.poll() is None:
                proc.kill()
                proc.wait()
        fleet.stop()


def test_agent_sigterm_and_status_command(fleet_broker, tmp_path):
    """Prometheus shows the round; an agent stops cleanly on SIGTERM; `status` reads the state a real round wrote."""
    fleet = Fleet(tmp_path, fleet_broker, FED, ["dev-0"])
    coordinator = make_coordinator(fleet_broker, fleet, tmp_path, round_timeout=30)
    try:
        coordinator.wait_for_devices(1, 120)
        port = free_port()
        coordinator.metrics.serve(port)
        coordinator.run_round(1)
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'edgefl_rounds_total{outcome="complete"} 1.0' in scrape
        assert "edgefl_updates_accepted_total 1.0" in scrape and "edgefl_test_accuracy" in scrape
        # SIGTERM: the agent flushes its state, says it is offline, and exits 0
        agent = fleet.processes["dev-0"]
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        give_up = time.monotonic() + 10
        while "dev-0" in coordinator.presence.online and time.monotonic() < give_up:
            coordinator.drain(0.2)
        assert "dev-0" not in coordinator.presence.online
        assert (tmp_path / "dev-0" / "state" / "state.msgpack").exists()
    finally:
        coordinator.close()
        fleet.stop()
    config = tmp_path / "c.toml"
    config.write_text(to_toml({"pacing": {"interval": 0, "patience": 0}, "federation": {"name": FED, "model": "digits_mlp", "test_data": "unused.npz"},
                               "broker": {"password": "x"}, "storage": {"state_dir": str(tmp_path / "coordinator")}}))
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "status", "--config", str(config)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "last round 1 (model version 1" in result.stdout
    assert "dev-0" in result.stdout and "rounds folded 1, clipped 0, left out 0" in result.stdout
