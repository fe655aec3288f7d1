"""Shared fixtures. `broker` starts a real Mosquitto with the project's own
generated config (no anonymous access, per-device ACL) on a free loopback
port, waits until it accepts connections, and stops exactly that process."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
import torch

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.simulation.private_broker import PrivateBroker
from edgefl_protocol.transport import connect, make_client

FEDERATION = "test"

# One torch thread in each test process and in the processes it starts (the coordinators `simulate`
# runs; agents already train with [device] threads = 1): the tests run in one worker per core
# (pytest-xdist, pyproject.toml), and torch's default of a thread per core in every worker puts more
# spinning threads than cores on the machine, where a 3 s in-process federation took 80 s of CPU.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture
def broker(tmp_path) -> Iterator[PrivateBroker]:
    b = PrivateBroker(tmp_path / "broker", FEDERATION)
    b.add_user(COORDINATOR_USER)
    for name in ("dev-a", "dev-b"):
        b.add_user(name)
    with b:
        yield b


class Recorder:
    """A connected paho client that records what it receives."""

    def __init__(self, client: mqtt.Client) -> None:
        self.client = client
        self.messages: list[tuple[str, bytes]] = []
        self.received = threading.Event()
        self._arrived = threading.Condition()
        client.on_message = self._on_message

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        with self._arrived:
            self.messages.append((msg.topic, msg.payload))
            self.received.set()
            self._arrived.notify_all()

    def wait_for(self, topic: str, payload: bytes, within: float = 10.0, forget: bool = False) -> None:
        """Until (topic, payload) has arrived. Mosquitto queues a subscriber's messages in the order it took
        them in, so whatever a client had published (and seen acknowledged) before this message reached
        this subscriber first, or never will: absence can be asserted after it without sleeping."""
        with self._arrived:
            assert self._arrived.wait_for(lambda: (topic, payload) in self.messages, within), \
                f"{payload!r} on {topic} did not arrive within {within} s (got {self.messages})"
            if forget:  # a marker, not one of the messages the test asserts on
                self.messages.remove((topic, payload))

    def subscribe(self, topic: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *args: done.set()
        self.client.subscribe(topic, qos=1)
        assert done.wait(5), f"no SUBACK for {topic}"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def flush(publisher: Recorder, observer: Recorder, topic: str) -> None:
    """`publisher` sends a fresh marker on `topic` (which `observer` reads) and waits until `observer` has it,
    then forgets it: every message acknowledged to anyone before has then reached `observer`, or never will."""
    marker = f"marker-{uuid.uuid4().hex}".encode()
    publisher.client.publish(topic, marker, qos=1).wait_for_publish(5)
    observer.wait_for(topic, marker, forget=True)


@pytest.fixture
def mqtt_client(broker):
    """Factory: mqtt_client(user) -> a connected Recorder using that user's broker password."""
    made: list[Recorder] = []

    def factory(user: str, password: str | None = None) -> Recorder:
        client = make_client(f"{user}-test-{len(made)}", user, password or broker.users[user])
        recorder = Recorder(client)
        connect(client, broker.host, broker.port, timeout=10)
        made.append(recorder)
        return recorder

    yield factory
    for recorder in made:
        recorder.close()
