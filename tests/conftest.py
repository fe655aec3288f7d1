"""Shared fixtures. `broker` starts a real Mosquitto with the project's own
generated config (no anonymous access, per-device ACL) on a free loopback
port, waits until it accepts connections, and stops exactly that process."""

from __future__ import annotations

import os
import threading
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
        client.on_message = self._on_message

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        self.messages.append((msg.topic, msg.payload))
        self.received.set()

    def subscribe(self, topic: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *args: done.set()
        self.client.subscribe(topic, qos=1)
        assert done.wait(5), f"no SUBACK for {topic}"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


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
