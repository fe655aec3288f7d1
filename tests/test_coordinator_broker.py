"""The coordinator against a real Mosquitto without agents: what it learns from the broker
(presence at start-up, retained updates) and what it tells devices (receipts)."""

from __future__ import annotations

import time

import pytest

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.rounds import RoundFailed
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.in_memory import fold_round
from broker_coordinator.simulation.private_broker import PrivateBroker
from edgefl_protocol import codec, messages, signing, topics
from edgefl_models import datasets

FED = "cb"


def _broker(tmp_path, devices) -> PrivateBroker:
    broker = PrivateBroker(tmp_path / "broker", FED)
    broker.add_user(COORDINATOR_USER)
    for d in devices:
        broker.add_user(d)
    return broker



def test_first_round_with_all_devices_selects_every_online_device(tmp_path):
    """clients_per_round = 0 means every eligible device; the first round after a start used only the
    first `min_updates` devices whose retained status had arrived."""
    from edgefl_protocol.transport import connect, make_client
    devices = [f"dev-{i}" for i in range(6)]
    with _broker(tmp_path, devices) as broker:
        for d in devices:  # each device leaves its retained status, as an agent does
            client = make_client(f"{d}-x", d, broker.users[d])
            connect(client, broker.host, broker.port)
            status = messages.Status(d, "online", {"busy": False, "last_round": 0})
            client.publish(topics.status(FED, d), messages.encode("status", status), qos=1,
                           retain=True).wait_for_publish(5)
            client.disconnect()
            client.loop_stop()
        coordinator = Engine(FED, "digits_mlp", datasets.load("digits").test,
                                  RoundSettings(clients_per_round=0, min_updates=1, round_timeout=1.5))
        coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            rnd = coordinator.schedule.attempt(coordinator, 1, 1)  # nobody answers: abandoned, but the cohort is what matters
            assert rnd.cohort == set(devices)
        finally:
            coordinator.close()


def test_a_retained_update_is_rejected_and_cleared(tmp_path, caplog):
    from edgefl_protocol.transport import connect, make_client
    with _broker(tmp_path, ["dev-a"]) as broker:
        client = make_client("dev-a", "dev-a", broker.users["dev-a"])
        connect(client, broker.host, broker.port)
        client.publish(topics.update(FED, "dev-a"), b"junk that replays on every reconnect", qos=1,
                       retain=True).wait_for_publish(5)
        client.disconnect()
        client.loop_stop()
        coordinator = Engine(FED, "digits_mlp", datasets.load("digits").test, RoundSettings())
        coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            give_up = time.monotonic() + 30
            while coordinator.intake.rejections["retained"] == 0 and time.monotonic() < give_up:
                coordinator.drain(0.2)
            assert coordinator.intake.rejections["retained"] == 1
            settle = time.monotonic() + 1  # the clearing publish is asynchronous: let it reach the broker
            while time.monotonic() < settle:
                coordinator.drain(0.2)
        finally:
            coordinator.close()
        # it was cleared: a new subscriber gets nothing retained on that topic
        again = Engine(FED, "digits_mlp", datasets.load("digits").test, RoundSettings())
        again.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                again.drain(0.2)
            assert again.intake.rejections["retained"] == 0
        finally:
            again.close()


def test_an_update_sent_while_the_coordinator_is_away_reaches_it_when_it_returns(tmp_path):
    """The coordinator's session is persistent: the broker queues what devices send while it reconnects
    (before, a clean session dropped it without a log line)."""
    from edgefl_protocol.transport import connect, make_client
    test_set = datasets.load("digits").test
    with _broker(tmp_path, ["dev-a"]) as broker:
        first = Engine(FED, "digits_mlp", test_set, RoundSettings())
        first.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        first.settle_presence()  # subscribed
        first.close()
        device = make_client("dev-a", "dev-a", broker.users["dev-a"])
        connect(device, broker.host, broker.port)
        device.publish(topics.update(FED, "dev-a"), b"an update while nobody listens", qos=1).wait_for_publish(5)
        device.disconnect()
        device.loop_stop()
        again = Engine(FED, "digits_mlp", test_set, RoundSettings())
        again.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            give_up = time.monotonic() + 30
            while not again.intake.rejections and time.monotonic() < give_up:
                again.drain(0.2)
            assert again.intake.rejections == {"unknown_key": 1}  # it arrived (and, unsigned, was rejected)
        finally:
            again.close()


def test_a_reset_state_directory_never_reuses_a_version_the_broker_still_holds(tmp_path):
    """An earlier run left version 7's manifest retained; a coordinator with a fresh state directory
    starts at 8 and clears the old manifest, so no device can take the old model for the new one."""
    from edgefl_protocol.transport import connect, make_client
    with _broker(tmp_path, []) as broker:
        old = make_client("old-run", COORDINATOR_USER, broker.users[COORDINATOR_USER])
        connect(old, broker.host, broker.port)
        old.publish(topics.model(FED, 7), b"an earlier run's manifest", qos=1, retain=True).wait_for_publish(5)
        old.disconnect()
        old.loop_stop()
        coordinator = Engine(FED, "digits_mlp", None, RoundSettings(evaluate="devices"))
        assert coordinator.version == 0
        coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            assert coordinator.version == 8
        finally:
            coordinator.close()
        again = Engine(FED, "digits_mlp", None, RoundSettings(evaluate="devices"))
        again.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            assert again.version == 0  # the old manifest was cleared; nothing of ours is retained yet
        finally:
            again.close()


def test_an_update_trained_on_another_model_of_the_same_version_is_rejected_with_a_receipt():
    key = signing.new_key()
    coordinator = Engine(FED, "digits_mlp", datasets.load("digits").test,
                              RoundSettings(codec="float32", algorithm="fedavg"), device_keys={"dev-0": key})
    coordinator.releases.sha[0] = "ab" * 32  # what this run released as version 0
    zero = {n: a * 0 for n, a in coordinator.weights.items()}
    encoded = codec.encode(zero, "float32")
    update = messages.Update("dev-0", 1, 0, 10, {"steps": 1, "model_sha": "cd" * 8}, encoded.body, "float32",
                             encoded.specs, FED, 1)
    with pytest.raises(RoundFailed, match="wrong_base"):
        fold_round(coordinator, {"dev-0": messages.encode_update(update, key)}, 1)
    assert coordinator.intake.rejections == {"wrong_base": 1}
