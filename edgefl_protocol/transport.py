"""An MQTT v5 session (paho-mqtt 2.x) that stays up on a flaky network.

paho's own reconnect waits a deterministic, doubling delay, so after a broker
restart every device of a fleet comes back in the same instant. `Session`
turns paho's reconnect off and runs its own: exponential backoff with random
jitter, reset after each accepted connection. Subscriptions belong in the
`on_connect` callback, which runs on every (re)connect, so they are renewed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

log = logging.getLogger("edgefl.transport")
MAX_QUEUED_MESSAGES = 1000  # bounded outgoing queue: a dead link must not eat the device's memory


class BrokerUnavailable(Exception):
    """The broker refused or did not answer; the message says which and why."""


def make_client(client_id: str, username: str, password: str, reconnect_on_failure: bool = True,
                tls_ca: str | None = None, max_queued: int = MAX_QUEUED_MESSAGES) -> mqtt.Client:
    """An MQTT v5 client; with `tls_ca` (a CA certificate file) it speaks TLS and verifies the broker.
    `max_queued` bounds paho's outgoing queue (0 = unbounded)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5,
                         reconnect_on_failure=reconnect_on_failure)
    client.username_pw_set(username, password)
    if tls_ca:
        client.tls_set(ca_certs=tls_ca)
    client.max_queued_messages_set(max_queued)
    return client


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random = random._inst) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d], d = min(cap, base * 2^attempt)."""
    ceiling = min(cap, base * (2 ** min(attempt, 30)))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


def connect(client: mqtt.Client, host: str, port: int, keepalive: int = 60, timeout: float = 20.0) -> None:
    """One-shot connect for tools and tests: start paho's loop, return once accepted, raise if refused."""
    accepted = threading.Event()
    refused: list[str] = []
    user_on_connect = client.on_connect

    def on_connect(c, userdata, flags, reason_code, properties):  # noqa: ANN001 (paho signature)
        if reason_code.is_failure:
            refused.append(str(reason_code))
        if user_on_connect:
            user_on_connect(c, userdata, flags, reason_code, properties)
        accepted.set()

    client.on_connect = on_connect
    try:
        client.connect_async(host, port, keepalive=keepalive)
    except (OSError, ValueError) as exc:
        raise BrokerUnavailable(f"cannot reach broker {host}:{port}: {exc}") from None
    client.loop_start()
    if not accepted.wait(timeout) or refused:
        client.loop_stop()
        if refused:
            raise BrokerUnavailable(f"broker {host}:{port} refused the connection: {refused[0]}")
        raise BrokerUnavailable(f"broker {host}:{port}: no answer within {timeout:.0f} s")
    client.on_connect = user_on_connect


class Session:
    """A long-lived connection: `start()`, then `publish_until()`; `stop()` at the end.

    `on_connect(client)` runs on paho's thread after every accepted connection;
    `on_message(client, msg)` for every message. Both must be quick.
    """

    def __init__(self, client_id: str, username: str, password: str, host: str, port: int,
                 on_connect: Callable[[mqtt.Client], None], on_message: Callable[[mqtt.Client, mqtt.MQTTMessage], None],
                 keepalive: int = 60, will: tuple[str, bytes] | None = None,
                 backoff_base: float = 1.0, backoff_cap: float = 60.0, tls_ca: str | None = None,
                 session_expiry: int = 0, max_queued: int = MAX_QUEUED_MESSAGES) -> None:
        """`session_expiry` > 0 asks for a persistent session: the broker keeps the subscriptions and
        queues QoS 1 messages for that many seconds while we are away, and delivers them on reconnect."""
        self.host, self.port, self.keepalive = host, port, keepalive
        self.backoff_base, self.backoff_cap = backoff_base, backoff_cap
        self.session_expiry = session_expiry
        self.client = make_client(client_id, username, password, reconnect_on_failure=False, tls_ca=tls_ca,
                                  max_queued=max_queued)
        if will:
            self.client.will_set(will[0], will[1], qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, msg: on_message(c, msg)
        self._user_on_connect = on_connect
        self.connected = threading.Event()
        self.ever_connected = threading.Event()
        self.refused: str | None = None
        self.reconnects = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mqtt-{client_id}", daemon=True)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            # said once at ERROR (a revoked device retries with backoff for as long as it runs), again
            # only when the reason changes
            said, self.refused = self.refused, str(reason_code)
            log.log(logging.DEBUG if said == self.refused else logging.ERROR,
                    "broker %s:%d refused the connection: %s%s", self.host, self.port, reason_code,
                    "; its credentials are not (or no longer) valid: was it revoked or its password rotated? "
                    "Enroll it again, or stop the service" if "authori" in self.refused.lower()
                    or "password" in self.refused.lower() else "")
            return
        self.refused = None
        self.connected.set()
        if self.ever_connected.is_set():
            self.reconnects += 1
            log.info("reconnected to %s:%d", self.host, self.port)
        self.ever_connected.set()
        self._user_on_connect(client)

    def _run(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            try:
                if self.session_expiry:
                    props = Properties(PacketTypes.CONNECT)
                    props.SessionExpiryInterval = self.session_expiry
                    self.client.connect(self.host, self.port, keepalive=self.keepalive, clean_start=False,
                                        properties=props)
                else:
                    self.client.connect(self.host, self.port, keepalive=self.keepalive)
            except OSError as exc:
                log.warning("cannot reach broker %s:%d: %s", self.host, self.port, exc)
            else:
                self.client.loop_forever()  # returns when the connection drops
                if self.connected.is_set():
                    attempt = 0  # it was accepted: start the backoff afresh
                self.connected.clear()
            if self._stopping.is_set():
                break
            delay = backoff_delay(attempt, self.backoff_base, self.backoff_cap)
            attempt += 1
            log.info("connection lost; retrying in %.1f s", delay)
            self._stopping.wait(delay)

    def start(self, timeout: float = 30.0) -> None:
        """Connect; raise BrokerUnavailable if the broker refuses us or never answers within `timeout`."""
        self._thread.start()
        give_up = time.monotonic() + timeout
        while not self.connected.wait(0.1):
            if self.refused or time.monotonic() > give_up:
                self._stopping.set()
                self.client.disconnect()
                raise BrokerUnavailable(
                    f"broker {self.host}:{self.port} refused the connection: {self.refused}" if self.refused
                    else f"broker {self.host}:{self.port}: no connection within {timeout:.0f} s")

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> mqtt.MQTTMessageInfo:
        return self.client.publish(topic, payload, qos=qos, retain=retain)

    def publish_until(self, topic: str, payload: bytes, deadline: float, qos: int = 1, retain: bool = False) -> bool:
        """Publish and wait for the broker's acknowledgement, retrying across reconnects until `deadline`
        (unix seconds). Returns False if it never got through."""
        while time.time() < deadline and not self._stopping.is_set():
            if not self.connected.wait(min(1.0, max(0.0, deadline - time.time()))):
                continue
            info = self.client.publish(topic, payload, qos=qos, retain=retain)
            try:
                info.wait_for_publish(timeout=min(10.0, max(0.1, deadline - time.time())))
            except (RuntimeError, ValueError):
                pass  # not queued (disconnected or queue full): retry
            if info.is_published():
                return True
            time.sleep(0.2)
        return False

    def publish_all(self, messages: list[tuple[str, bytes]], deadline: float, qos: int = 1) -> list[str]:
        """Publish every (topic, payload) and wait until the broker has acknowledged each, retrying what
        paho could not queue or what a reconnect lost, until `deadline`. Returns the topics that never
        got through (each should be logged by the caller with what it meant)."""
        pending = dict(enumerate(messages))
        while pending and time.time() < deadline and not self._stopping.is_set():
            if not self.connected.wait(min(1.0, max(0.0, deadline - time.time()))):
                continue
            infos = {i: self.client.publish(topic, payload, qos=qos) for i, (topic, payload) in pending.items()}
            for i, info in infos.items():
                if info.rc != mqtt.MQTT_ERR_SUCCESS:
                    continue  # not queued (queue full, or the link dropped): the next pass retries it
                try:
                    info.wait_for_publish(timeout=min(10.0, max(0.1, deadline - time.time())))
                except (RuntimeError, ValueError):
                    continue
                if info.is_published():
                    pending.pop(i)
            if pending:
                time.sleep(0.2)
        return [messages[i][0] for i in sorted(pending)]

    def stop(self, last_words: tuple[str, bytes] | None = None) -> None:
        """Optionally publish one retained message (e.g. status offline), then disconnect cleanly."""
        if last_words and self.connected.is_set():
            self.publish_until(last_words[0], last_words[1], time.time() + 5, retain=True)
        self._stopping.set()
        self.client.disconnect()
        self._thread.join(timeout=10)
