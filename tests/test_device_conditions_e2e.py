"""Device conditions against a real Mosquitto and real agent processes: a device outside its owner's
training hours says so in its retained status, the coordinator's round does not select it while the
other device trains, and the stored presence, `devices list`, `edge-agent status` and its signed
refusal of a task sent anyway all say why."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from broker_coordinator.access.broker import COORDINATOR_USER, admin_password, admin_user, hash_password
from broker_coordinator.access.registry import Registry
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.rounds import RoundState
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.private_broker import PrivateBroker
from broker_coordinator.simulation.processes import stop_processes
from broker_coordinator.storage.store import Store
from edgefl_protocol import messages, protocol, signing, topics
from edgefl_protocol.settings import to_toml
from edgefl_protocol.transport import connect, make_client
from edgefl_models import datasets, partition

from .conftest import Recorder
from .fleet import spawn, write_agent
from .operator_fixtures import run_module

FED = "owners"
DEVICES = ("dev-0", "dev-1")  # dev-1's owner lets it train only in hours that exclude now


def hours_excluding_now() -> str:
    """A one-hour range that starts two hours from now (local time): now is outside it for the whole test."""
    hour = datetime.now().hour
    return f"{(hour + 2) % 24:02d}:00-{(hour + 3) % 24:02d}:00"


def wait_until(predicate, within: float, what: str, step=None) -> None:  # noqa: ANN001
    give_up = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        step() if step else time.sleep(0.2)


@pytest.fixture
def owners_broker(tmp_path):
    broker = PrivateBroker(tmp_path / "broker", FED)
    broker.add_user(COORDINATOR_USER)
    # the operator tools' user, with the password `devices list` derives from the coordinator's
    broker.users[admin_user(COORDINATOR_USER)] = admin_password(broker.users[COORDINATOR_USER])
    for device in DEVICES:
        broker.add_user(device)
    with broker:
        yield broker


def test_a_device_outside_its_hours_is_not_selected_and_says_why(owners_broker, tmp_path):
    hours = hours_excluding_now()
    why = f"outside training hours ({hours})"
    data = datasets.load("digits")
    shards = partition.split("iid", data.train.y, len(DEVICES), 0)
    keys = {device: signing.new_key() for device in DEVICES}
    state = tmp_path / "coordinator"
    registry = Registry(state / "coordinator.db")  # the devices, enrolled (for `devices list`)
    configs, processes = {}, {}
    try:
        for device, index in zip(DEVICES, shards):
            configs[device] = write_agent(tmp_path, owners_broker, FED, device, data.train.subset(index), keys[device])
            if device == "dev-1":
                configs[device].write_text(configs[device].read_text() + f'[conditions]\nhours = "{hours}"\n')
            registry.add(device, FED, hash_password("unused"), keys[device].hex(), f"token-{device}",
                         time.time() + 600)
            registry.activate(device, f"token-{device}", hash_password(owners_broker.users[device]))
            processes[device] = spawn(["-m", "edge_agent", "run", "--config", str(configs[device])],
                                      tmp_path / device / "agent.log")
        run_the_round(owners_broker, tmp_path, data, keys, why)
        show_why(owners_broker, tmp_path, configs, keys, hours, why)
    finally:
        stop_processes(processes.values())


def run_the_round(broker: PrivateBroker, tmp_path, data, keys: dict[str, bytes], why: str) -> None:  # noqa: ANN001
    """The coordinator's round selects dev-0 only, and its stored presence says why not dev-1."""
    state = tmp_path / "coordinator"
    cohorts: list[set[str]] = []
    coordinator = Engine(FED, "digits_mlp", data.test,
                         RoundSettings(local_epochs=1, min_updates=1, clients_per_round=0, round_timeout=30),
                         store=Store(state), device_keys=keys,
                         on_state=lambda rnd: cohorts.append(set(rnd.cohort)) if rnd.state == RoundState.OPEN else None)
    coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
    try:
        # both agents online (importing torch takes a while), dev-1 saying it may not train
        wait_until(lambda: set(coordinator.presence.online) == set(DEVICES)
                   and coordinator.presence.not_eligible().get("dev-1") == why, 180,
                   "both agents' statuses, dev-1's saying why it may not train",
                   step=lambda: coordinator.drain(0.2))
        assert coordinator.presence.eligible() == ["dev-0"]

        record = coordinator.run_round(1)
        assert cohorts == [{"dev-0"}]  # dev-1 was online and idle, and not selected
        assert (record.closed, record.selected, record.participants) == ("complete", 1, 1)
        assert set(record.devices) == {"dev-0"} and not record.refused
        assert "trained (" in (tmp_path / "dev-0" / "agent.log").read_text()
        assert "trained (" not in (tmp_path / "dev-1" / "agent.log").read_text()
    finally:
        coordinator.close()  # its presence rows are flushed
    stored = {d["device"]: json.loads(d["profile"]) for d in Store(state).devices()}
    assert stored["dev-1"]["eligible"] is False and stored["dev-1"]["why"] == why
    assert stored["dev-0"]["eligible"] is True and "why" not in stored["dev-0"]


def show_why(broker: PrivateBroker, tmp_path, configs: dict, keys: dict[str, bytes], hours: str,  # noqa: ANN001
             why: str) -> None:
    """`devices list` (live, and from the stored presence), `edge-agent status`, and a signed refusal."""
    config = tmp_path / "coordinator.toml"
    config.write_text(to_toml({
        "federation": {"name": FED, "model": "digits_mlp", "test_data": "unused.npz"},
        "broker": {"host": broker.host, "port": broker.port, "password": broker.users[COORDINATOR_USER]},
        "storage": {"state_dir": str(tmp_path / "coordinator")}}))
    for probe in ((), ("--no-probe",)):
        listing = run_module("broker_coordinator", "devices", "list", *probe, "--config", str(config))
        assert listing.returncode == 0, listing.stderr
        assert f"  dev-1: {why}" in listing.stdout and "dev-0:" not in listing.stdout, listing.stdout

    shown = run_module("edge_agent", "status", "--config", str(configs["dev-1"]))
    assert f"conditions: hours {hours}" in shown.stdout and f"may train:  no: {why}" in shown.stdout, shown.stdout
    shown = run_module("edge_agent", "status", "--config", str(configs["dev-0"]))
    assert "may train:  yes" in shown.stdout, shown.stdout

    # a task sent anyway (by a coordinator that has not seen the status yet): refused, signed, saying why
    client = make_client("coordinator-probe", COORDINATOR_USER, broker.users[COORDINATOR_USER])
    recorder = Recorder(client)
    connect(client, broker.host, broker.port, timeout=10)
    try:
        recorder.subscribe(topics.update(FED, "dev-1"))
        task = messages.Task(round=2, model_version=1, deadline=time.time() + 20, algorithm="fedavg")
        sealed = protocol.seal("task", task, protocol.SPOKEN[-1], keys["dev-1"])  # signed, as the coordinator does
        client.publish(topics.task(FED, "dev-1"), sealed, qos=1).wait_for_publish(5)
        wait_until(lambda: recorder.messages, 30, "dev-1's answer")
        answer = messages.decode_answer(recorder.messages[0][1], 65536, keys["dev-1"], "dev-1")
    finally:
        recorder.close()
    assert isinstance(answer, messages.Refusal) and (answer.reason, answer.detail) == ("ineligible", why)
    assert f"round 2: refusing the task: {why}" in (tmp_path / "dev-1" / "agent.log").read_text()
