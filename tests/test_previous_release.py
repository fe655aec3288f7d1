"""The previous release (0.1.0, the git tag v0.1.0) beside this one, against a real Mosquitto: its
agent (protocol 1) and this release's (protocol 2) train in the same rounds and both are folded; a
coordinator that stops serving protocol 1 leaves the old agent out, tells the operator once, and
nobody crashes; this release's agent trains for 0.1.0's coordinator; the configs 0.1.0 wrote load.

0.1.0 runs from `git archive v0.1.0` of this repository, with this venv's packages (the
same dependencies). Every wait is for a condition: the coordinator runs its rounds and exits.
"""

from __future__ import annotations

import io
import os
import re
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from broker_coordinator.settings.config import load_config
from edge_agent.config import load_config as load_agent_config
from edgefl_protocol.settings import to_toml

from .operator_fixtures import PROJECT_ROOT
from .test_tasks_e2e import Federation, start_federation, stop_federation, warnings_in

TAG = "v0.1.0"
OLD, NEW = "pi-01", "pi-02"


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory) -> Path:
    """0.1.0's packages, extracted from the tag."""
    done = subprocess.run(["git", "-C", str(PROJECT_ROOT), "archive", TAG, "broker_coordinator", "edge_agent",
                           "edgefl_protocol", "models", "docs/OPERATOR.md"], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"the tag {TAG} is not in this clone ({done.stderr.decode().strip()}): fetch the tags")
    root = tmp_path_factory.mktemp("edgefl-0.1.0")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(root, filter="data")
    return root


def as_enroll_wrote_it(config: Path) -> None:
    """The agent config in the layout 0.1.0's `edge-agent enroll` writes (both releases read it)."""
    import tomllib
    raw = tomllib.loads(config.read_text())
    b, d = raw["broker"], raw["device"]
    config.write_text("# Written by 'edge-agent enroll'. Holds this device's broker password and signing key.\n"
                      + to_toml({"broker": {"host": b["host"], "port": b["port"], "username": b["username"],
                                            "password": b["password"], "tls_ca": ""},
                                 "device": {"id": d["id"], "federation": d["federation"], "data": d["data"],
                                            "state_dir": d["state_dir"], "signing_key": d["signing_key"]}}))


def mixed_federation(tmp_path: Path, old_code: Path) -> Federation:
    def start(device: str, config: Path) -> subprocess.Popen:
        as_enroll_wrote_it(config)
        old = device == OLD
        env = dict(os.environ, PYTHONPATH=str(old_code if old else PROJECT_ROOT))
        with open(config.parent / "agent.log", "wb") as out:  # the old one from its own tree: cwd wins sys.path[0]
            return subprocess.Popen([sys.executable, "-m", "edge_agent", "run", "--config", str(config)], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=old_code if old else PROJECT_ROOT)
    return start_federation(tmp_path, (OLD, NEW), start)


def accepted(state: Path, round_no: int) -> list[str]:
    db = sqlite3.connect(state / "coordinator.db")
    try:
        return sorted(d for (d,) in db.execute("SELECT device FROM device_rounds WHERE round = ? AND accepted = 1",
                                               (round_no,)))
    finally:
        db.close()


def test_an_agent_of_the_previous_protocol_and_one_of_this_train_in_the_same_rounds(tmp_path, previous_release):
    fed = mixed_federation(tmp_path, previous_release)
    try:
        done = fed.run(rounds=2)
        assert "finished 2 rounds" in done.stdout, done.stdout + done.stderr
        assert not warnings_in(done.stderr), warnings_in(done.stderr)  # two protocols alarm nobody
        assert accepted(fed.state, 1) == accepted(fed.state, 2) == [OLD, NEW]  # both folded, both rounds
        old_log, new_log = ((tmp_path / d / "agent.log").read_text() for d in (OLD, NEW))
        assert "accepted by the coordinator" in old_log and " ERROR " not in old_log, old_log[-3000:]
        assert "the coordinator speaks protocol version 2 to this agent" in new_log, new_log[-3000:]
        listing = fed.cli("devices", "list")
        assert "agent releases online: 0.1.0 x1" in listing.stdout or "unknown x1" in listing.stdout, listing.stdout
    finally:
        stop_federation(fed)


def test_a_coordinator_that_no_longer_serves_protocol_1_leaves_the_old_agent_out_and_says_so_once(
        tmp_path, previous_release):
    fed = mixed_federation(tmp_path, previous_release)
    try:
        text = fed.config.read_text()
        fed.config.write_text(text.replace("[federation]", "[federation]\nmin_protocol = 2", 1))
        done = fed.run(rounds=2, EDGEFL_COORDINATOR_SCHEDULE_MIN_UPDATES="1")
        assert "finished 2 rounds" in done.stdout, done.stdout + done.stderr
        warned = warnings_in(done.stderr)
        assert len(warned) == 1 and re.search(rf"WARNING .*{OLD} runs an agent that speaks protocol version\(s\) 1; "
                                              r"this coordinator serves 2: it is not selected until you install "
                                              r"edgefl>=0\.2\.0 on it", warned[0]), warned
        assert accepted(fed.state, 1) == accepted(fed.state, 2) == [NEW]
        listing = fed.cli("devices", "list")
        assert f"  {OLD}: its agent speaks protocol 1, the coordinator serves 2: install edgefl>=0.2.0" \
            in listing.stdout, listing.stdout
        assert all(agent.poll() is None for agent in fed.agents)  # neither side crashed
    finally:
        stop_federation(fed)


def test_the_configs_of_the_previous_release_load(tmp_path, previous_release):
    """The guide's coordinator.toml of 0.1.0, as written, and an agent.toml as its enroll wrote it."""
    guide = (previous_release / "docs" / "OPERATOR.md").read_text()
    sample = guide[guide.index("    [federation]\n"):guide.index("`test_data` is an `.npz`")]
    text = "\n".join(line[4:] for line in sample.splitlines())
    text = text.replace("<a long random string: openssl rand -base64 24>", "s3cret")
    (tmp_path / "coordinator.toml").write_text(text)
    config = load_config(tmp_path / "coordinator.toml")
    assert config.federation.name == "greenhouse" and config.federation.min_protocol == 1
    agent = tmp_path / "agent.toml"
    agent.write_text(to_toml({"broker": {"host": "broker.example.org", "port": 1883, "username": "pi-07",
                                         "password": "x", "tls_ca": ""},
                              "device": {"id": "pi-07", "federation": "greenhouse", "data": "/var/lib/edgefl/data.npz",
                                         "state_dir": "/var/lib/edgefl", "signing_key": "ab" * 32}}))
    as_enroll_wrote_it(agent)
    loaded = load_agent_config(agent)
    assert loaded.device.id == "pi-07" and loaded.serving.dir == "/var/lib/edgefl/serving"


def test_an_agent_of_this_release_trains_for_a_coordinator_of_the_previous_one(tmp_path, previous_release):
    """0.1.0's coordinator (a fleet provisioned by hand: device_keys.toml) and this release's agent:
    the agent speaks protocol 1 to it, unsigned tasks of protocol 1 included."""
    from broker_coordinator.access.broker import COORDINATOR_USER
    from broker_coordinator.simulation.private_broker import PrivateBroker
    from broker_coordinator.simulation.processes import stop_processes
    from edgefl_protocol import signing
    from edgefl_models import datasets

    from .fleet import spawn

    broker = PrivateBroker(tmp_path / "broker", "oldfed")
    password = broker.add_user(COORDINATOR_USER)
    broker.add_user(NEW)
    key = signing.new_key()
    state = tmp_path / "coordinator"
    state.mkdir()
    signing.write_key_file(state / "device_keys.toml", {NEW: key})
    data = datasets.load("digits")
    datasets.save_npz(tmp_path / "test.npz", data.test)
    datasets.save_npz(tmp_path / "data.npz", data.train.subset(range(300)))
    with broker:
        config = tmp_path / "coordinator.toml"
        config.write_text(to_toml({
            "federation": {"name": "oldfed", "model": "digits_mlp", "rounds": 2, "test_data": str(tmp_path / "test.npz")},
            "broker": {"host": broker.host, "port": broker.port, "username": COORDINATOR_USER, "password": password},
            "rounds": {"local_epochs": 1, "min_updates": 1, "clients_per_round": 0, "round_timeout": 60},
            "storage": {"state_dir": str(state)}}))
        (tmp_path / "agent.toml").write_text(to_toml({
            "broker": {"host": broker.host, "port": broker.port, "username": NEW, "password": broker.users[NEW]},
            "device": {"id": NEW, "data": str(tmp_path / "data.npz"), "state_dir": str(tmp_path / "state"),
                       "federation": "oldfed", "threads": 1, "signing_key": key.hex()}}))
        agent = spawn(["-m", "edge_agent", "run", "--config", str(tmp_path / "agent.toml")], tmp_path / "agent.log")
        try:
            old = subprocess.run([sys.executable, "-m", "broker_coordinator", "run", "--config", str(config)],
                                 capture_output=True, text=True, timeout=180, cwd=previous_release,
                                 env=dict(os.environ, PYTHONPATH=str(previous_release)))
        finally:
            stop_processes([agent])
    assert old.returncode == 0 and "finished 2 rounds" in old.stdout, old.stdout + old.stderr
    log = (tmp_path / "agent.log").read_text()
    assert "the coordinator speaks protocol version 1 to this agent" in log, log[-3000:]
    assert log.count("update accepted by the coordinator") == 2 and " ERROR " not in log, log[-3000:]
