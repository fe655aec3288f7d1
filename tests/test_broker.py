"""The generated Mosquitto config, against a real broker: auth and ACL."""

import pytest

from broker_coordinator.access.broker import BrokerError, hash_password
from broker_coordinator.simulation.private_broker import PrivateBroker
from edgefl_protocol import topics
from edgefl_protocol.transport import BrokerUnavailable, connect, make_client

from .conftest import FEDERATION, flush


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
    a.subscribe(topics.task(FEDERATION, "dev-a"))  # its own: where the marker below reaches it
    b.subscribe(topics.task(FEDERATION, "dev-b"))

    coordinator.client.publish(topics.task(FEDERATION, "dev-b"), b"task-for-b", qos=1).wait_for_publish(5)
    a.client.publish(topics.update(FEDERATION, "dev-b"), b"forged", qos=1).wait_for_publish(5)
    a.client.publish(topics.update(FEDERATION, "dev-a"), b"genuine", qos=1).wait_for_publish(5)

    b.wait_for(topics.task(FEDERATION, "dev-b"), b"task-for-b")
    coordinator.wait_for(topics.update(FEDERATION, "dev-a"), b"genuine")  # sent after the forged one
    flush(coordinator, a, topics.task(FEDERATION, "dev-a"))  # sent after the task for b
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


def test_broker_packet_limit_is_the_largest_message_the_coordinator_accepts_or_sends(tmp_path):
    """Before: the broker let through messages up to 2 float32 copies of the model + 256 KiB, far over the
    coordinator's update cap, and Mosquitto recommended max_packet_size. Now max_packet_size is the
    coordinator's cap (or a model chunk, if larger) plus header slack, from the same function."""
    import threading

    import numpy as np

    from broker_coordinator.settings import limits
    from broker_coordinator.settings.config import load_config
    from broker_coordinator.engine.loop import Engine
    from edgefl_models.datasets import Dataset

    from .conftest import Recorder
    from .operator_fixtures import FEDERATION as FIELD
    from .operator_fixtures import start_server, stop_server
    from .test_security import enrolled, session

    server = start_server(tmp_path / "server", message_size_limit=0)
    try:
        rounds = load_config(server.config_path).rounds
        coordinator = Engine(FIELD, "digits_mlp", Dataset(np.zeros((2, 64), np.float32), np.zeros(2, np.int64)),
                                  rounds)
        assert limits.federation_update_cap("digits_mlp", rounds) == coordinator.intake.terms.max_update_bytes
        limit = limits.packet_limit(coordinator.intake.terms.max_update_bytes, rounds.model_chunk_bytes)
        assert f"max_packet_size {limit}\n" in (server.root / "mosquitto/conf.d/edgefl.conf").read_text()

        password = enrolled(server, "dev-a")
        receiver: Recorder = session(server, server.config.broker.username, server.config.broker.password)
        receiver.subscribe(topics.all_updates(FIELD))
        device = session(server, "dev-a", password)
        dropped = threading.Event()
        device.client.on_disconnect = lambda *args: dropped.set()
        largest = limit - limits.PACKET_SLACK  # a whole update at the coordinator's cap, and a model chunk, fit
        assert largest >= coordinator.intake.terms.max_update_bytes and largest >= rounds.model_chunk_bytes
        device.client.publish(topics.update(FIELD, "dev-a"), b"u" * largest, qos=1).wait_for_publish(5)
        assert receiver.received.wait(5) and len(receiver.messages[0][1]) == largest
        device.client.publish(topics.update(FIELD, "dev-a"), b"x" * (limit + 1), qos=1)
        assert dropped.wait(5), "the broker accepted a packet over max_packet_size"
        device.client.loop_stop()
        again = session(server, "dev-a", password)  # a marker after the refused packet, from the same device
        flush(again, receiver, topics.update(FIELD, "dev-a"))
        again.close()
        assert len(receiver.messages) == 1
        receiver.close()
    finally:
        stop_server(server)


def test_a_picked_port_another_process_binds_first_is_replaced(tmp_path, monkeypatch):
    """Under parallel tests a free port can be bound by another broker between the pick and mosquitto's bind;
    before, the port answered for the other broker while this one had exited. Now a fresh port is picked."""
    from broker_coordinator.access.broker import free_port
    from broker_coordinator.simulation import private_broker

    with PrivateBroker(tmp_path / "holder", FEDERATION) as holder:
        picks = iter([holder.port])
        monkeypatch.setattr(private_broker, "free_port", lambda host: next(picks, None) or free_port(host))
        second = PrivateBroker(tmp_path / "second", FEDERATION)
        password = second.add_user("dev-x")
        with second:
            assert second.port != holder.port and second.process.poll() is None
            client = make_client("dev-x", "dev-x", password)
            connect(client, second.host, second.port, timeout=5)  # its own users: this broker, not the holder
            client.disconnect()
            client.loop_stop()
