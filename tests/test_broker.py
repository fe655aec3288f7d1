"""The generated Mosquitto config, against a real broker: auth and ACL."""

import time

import pytest

from broker_coordinator.broker import BrokerError, PrivateBroker, hash_password
from edgefl_protocol import topics
from edgefl_protocol.transport import BrokerUnavailable, connect, make_client

from .conftest import FEDERATION


def test_password_hash_has_mosquitto_format():
    fields = hash_password("secret", salt=b"0123456789ab").split("$")
    assert fields[1:3] == ["7", "101"] and len(fields) == 5


def test_wrong_password_is_refused(broker):
    client = make_client("intruder", "dev-a", "wrong-password")
    with pytest.raises(BrokerUnavailable, match="refused"):
        connect(client, broker.host, broker.port, timeout=5)


def test_anonymous_is_refused(broker):
    client = make_client("anon", "", "")
    client.username_pw_set(None, None)
    with pytest.raises(BrokerUnavailable, match="refused"):
        connect(client, broker.host, broker.port, timeout=5)


def test_device_cannot_read_another_devices_task_or_write_its_update(mqtt_client):
    coordinator = mqtt_client("coordinator")
    a, b = mqtt_client("dev-a"), mqtt_client("dev-b")
    coordinator.subscribe(topics.all_updates(FEDERATION))
    a.subscribe(topics.task(FEDERATION, "dev-b"))  # denied by the ACL (SUBACK still arrives)
    b.subscribe(topics.task(FEDERATION, "dev-b"))

    coordinator.client.publish(topics.task(FEDERATION, "dev-b"), b"task-for-b", qos=1).wait_for_publish(5)
    a.client.publish(topics.update(FEDERATION, "dev-b"), b"forged", qos=1).wait_for_publish(5)
    a.client.publish(topics.update(FEDERATION, "dev-a"), b"genuine", qos=1).wait_for_publish(5)

    assert b.received.wait(5) and coordinator.received.wait(5)
    time.sleep(0.5)  # let any (wrongly) routed message arrive before asserting absence
    assert b.messages == [(topics.task(FEDERATION, "dev-b"), b"task-for-b")]
    assert a.messages == []
    assert coordinator.messages == [(topics.update(FEDERATION, "dev-a"), b"genuine")]


def test_port_in_use_is_reported(broker, tmp_path):
    second = PrivateBroker(tmp_path / "second", FEDERATION, port=broker.port)
    with pytest.raises(BrokerError, match="already in use"):
        second.start()


def test_missing_binary_is_reported(tmp_path):
    with pytest.raises(BrokerError, match="not executable"):
        PrivateBroker(tmp_path, FEDERATION, mosquitto=str(tmp_path / "no-mosquitto")).start()
