"""How the engine reaches devices and sites: one interface, over MQTT or in memory (as Flower's
`Grid` and `InMemoryGrid`).

The engine only ever publishes (tasks, receipts, retained model releases) and reads its inbox of
(topic, payload, arrival time, retained) messages; what carries them is the transport's business.
`MqttTransport` is a paho session whose network thread only queues what arrives, so every decision
happens on the engine's thread. `InMemoryTransport` keeps retained messages in a dict and hands
every publication to an optional callback: tests and benchmarks put answers in its inbox and the
engine validates, folds and receipts them with exactly the code a broker would feed.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Protocol

from edgefl_protocol.transport import Session

Message = tuple[str, bytes, float, bool]  # topic, payload, arrival time, retained


class Transport(Protocol):
    inbox: queue.Queue[Message]

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None: ...

    def publish_until(self, topic: str, payload: bytes, deadline: float, retain: bool = False) -> bool:
        """Publish and wait for the broker's confirmation until `deadline`; whether it came."""

    def publish_all(self, payloads: list[tuple[str, bytes]], deadline: float) -> list[str]:
        """Publish each (topic, payload), confirmed by `deadline`; the topics that were not."""


class MqttTransport:
    """The engine's MQTT session: a persistent session whose messages land in `inbox`."""

    def __init__(self, client_id: str, username: str, password: str, host: str, port: int,
                 on_connect: Callable, keepalive: int = 60, **session: object) -> None:
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.session = Session(client_id, username, password, host, port, on_connect=on_connect,
                               on_message=lambda c, msg: self.inbox.put((msg.topic, msg.payload, time.time(),
                                                                         bool(msg.retain))),
                               keepalive=keepalive, **session)

    def start(self, timeout: float) -> None:
        self.session.start(timeout)

    def stop(self, last_words: tuple[str, bytes] | None = None) -> None:
        self.session.stop(last_words)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.session.publish(topic, payload, qos=1, retain=retain)

    def publish_until(self, topic: str, payload: bytes, deadline: float, retain: bool = False) -> bool:
        return self.session.publish_until(topic, payload, deadline, retain=retain)

    def publish_all(self, payloads: list[tuple[str, bytes]], deadline: float) -> list[str]:
        return self.session.publish_all(payloads, deadline)


class InMemoryTransport:
    """No broker: retained messages in a dict, each publication handed to `on_publish` (a device
    or site run in process may answer by `deliver`ing to the inbox)."""

    def __init__(self, on_publish: Callable[[str, bytes], None] | None = None) -> None:
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.retained: dict[str, bytes] = {}
        self.on_publish = on_publish

    def deliver(self, topic: str, payload: bytes, retained: bool = False) -> None:
        """A message for the engine, as the broker would hand it over."""
        self.inbox.put((topic, payload, time.time(), retained))

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        if retain and payload:
            self.retained[topic] = payload
        elif retain:
            self.retained.pop(topic, None)
        if self.on_publish is not None:
            self.on_publish(topic, payload)

    def publish_until(self, topic: str, payload: bytes, deadline: float, retain: bool = False) -> bool:
        self.publish(topic, payload, retain)
        return True

    def publish_all(self, payloads: list[tuple[str, bytes]], deadline: float) -> list[str]:
        for topic, payload in payloads:
            self.publish(topic, payload)
        return []
