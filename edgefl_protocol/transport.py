"""One way to open an MQTT v5 session with paho-mqtt 2.x, used by both sides."""

from __future__ import annotations

import threading

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


class BrokerUnavailable(Exception):
    """The broker refused or did not answer; the message says which and why."""


def make_client(client_id: str, username: str, password: str, tls_ca: str | None = None) -> mqtt.Client:
    """An MQTT v5 client; with `tls_ca` (a CA certificate file) it speaks TLS and verifies the broker."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.username_pw_set(username, password)
    if tls_ca:
        client.tls_set(ca_certs=tls_ca)
    client.max_queued_messages_set(1000)  # bounded outgoing queue
    return client


def connect(client: mqtt.Client, host: str, port: int, keepalive: int = 60, timeout: float = 20.0) -> None:
    """Connect and start paho's network thread; return once the broker has accepted us.

    The caller's own on_connect (set beforehand) still runs on every (re)connect.
    """
    accepted = threading.Event()
    refused: list[str] = []
    user_on_connect = client.on_connect

    def on_connect(c, userdata, flags, reason_code, properties):  # noqa: ANN001 (paho signature)
        if reason_code.is_failure:
            refused.append(str(reason_code))
        else:
            accepted.set()
        if user_on_connect:
            user_on_connect(c, userdata, flags, reason_code, properties)
        if refused or accepted.is_set():
            accepted.set()

    client.on_connect = on_connect
    client.reconnect_delay_set(1, 30)
    try:
        client.connect_async(host, port, keepalive=keepalive)
    except (OSError, ValueError) as exc:
        raise BrokerUnavailable(f"cannot reach broker {host}:{port}: {exc}") from None
    client.loop_start()
    if not accepted.wait(timeout) or refused:
        client.loop_stop()
        reason = refused[0] if refused else f"no answer within {timeout:.0f} s"
        raise BrokerUnavailable(f"broker {host}:{port} refused the connection: {reason}"
                                if refused else f"broker {host}:{port}: {reason}")
    client.on_connect = user_on_connect
