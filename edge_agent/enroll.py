"""`edge-agent enroll TOKEN`: redeem a one-time token and write the agent config.

  1. decode the token and check its expiry (nothing is sent for an expired one);
  2. make sure the config path is writable before the token is spent;
  3. with TLS, obtain the CA certificate and check it against the token's fingerprint;
  4. sign in with the token's one-time password, send a new password made here,
     and wait for the coordinator's answer to that request (matched by a nonce; see
     edgefl_protocol.enrollment and `_redeem` for a second process with the same token);
  5. write the config (mode 0600), then connect with the new credentials.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edgefl_protocol import enrollment as proto
from edgefl_protocol import topics
from edgefl_protocol.persist import atomic_write
from edgefl_protocol.settings import to_toml
from edgefl_protocol.transport import BrokerUnavailable, connect, make_client

DEFAULT_CONFIG = Path("/etc/edgefl/agent.toml")
DEFAULT_STATE_DIR = "/var/lib/edgefl-agent"


class EnrollError(Exception):
    """Enrollment failed; the message says what to do."""


@dataclass
class Enrolled:
    device: str
    federation: str
    host: str
    port: int
    tls: bool
    config: Path


def check_writable(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.probe")
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        as_root = hasattr(os, "geteuid") and os.geteuid() == 0
        raise EnrollError(f"cannot write {path} ({exc.strerror}): "
                          + ("" if as_root else "run as root (sudo edge-agent enroll ...) or ")
                          + "choose another path with --config PATH") from None


def fetch_ca(token: proto.EnrollmentToken, ca_file: Path | None, dest: Path) -> Path:
    """The CA certificate whose SHA-256 matches the token: the given file, or the broker's own
    self-signed certificate, fetched and pinned by that fingerprint."""
    if ca_file is not None:
        try:
            pem = ca_file.read_text()
            der = ssl.PEM_cert_to_DER_cert(pem)
        except (OSError, ValueError) as exc:
            raise EnrollError(f"cannot read the CA certificate {ca_file}: {exc}") from None
        source = str(ca_file)
    else:
        try:
            pem = ssl.get_server_certificate((token.host, token.port), timeout=10)
        except OSError as exc:
            raise EnrollError(f"cannot fetch the broker's certificate from {token.host}:{token.port}: {exc}") from None
        der = ssl.PEM_cert_to_DER_cert(pem)
        source = f"the broker at {token.host}:{token.port}"
    if hashlib.sha256(der).hexdigest() != token.ca_sha256.lower():
        raise EnrollError(f"the certificate from {source} does not match the token's CA fingerprint: "
                          "pass the CA that signed the broker's certificate with --ca-file PATH")
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest, pem, 0o644)  # public; the service user must read it
    return dest


NO_ANSWER = ("no answer from the coordinator within the timeout: is 'broker-coordinator run' (or "
             "'broker-coordinator serve-enrollment') running on the server? The token was not used; try again")


# Reaching the broker has its own allowance: `--timeout` is how long to wait for the coordinator's answer,
# and a loaded broker can take over a second to accept a connection.
CONNECT_TIMEOUT = 15.0


class _Refused(Exception):
    """The broker refused the token's one-time password."""


def _redeem(token: proto.EnrollmentToken, new_password: str, ca: str | None, timeout: float) -> proto.EnrollAnswer:
    """Send the request and return the coordinator's answer to it (matched by nonce).

    The broker lets one connection per device in, so a second `edge-agent enroll` with the same token
    drops this session, and so does the broker's reload once the token is redeemed. After a drop
    before the answer: if our new password works, our request won; else ask again (the desk answers
    a retry of the winning request `ok` again) until the one-time password stops working, which
    means the token was used."""
    request = proto.EnrollRequest(token.device, token.token_id, new_password, secrets.token_hex(8))
    give_up = time.monotonic() + timeout
    retry = False
    while True:
        try:
            answer = _ask(token, request, ca, give_up)
        except _Refused:
            if retry and _accepted(token.host, token.port, token.device, new_password, ca):
                break
            raise EnrollError(f"the broker refused this token's one-time password: the token was already used, "
                              f"has expired, was replaced by 'devices rotate {token.device}', or the device was "
                              "revoked; "
                              "ask the operator for a new token") from None
        if answer is not None:
            return answer
        time.sleep(0.5)  # dropped before our answer: let a reload that redeemed the token finish
        if _accepted(token.host, token.port, token.device, new_password, ca):
            break
        retry = True
        if time.monotonic() > give_up:
            raise EnrollError(NO_ANSWER)
    return proto.EnrollAnswer(token.device, True, nonce=request.nonce)  # ours won; its answer was lost


def _ask(token: proto.EnrollmentToken, request: proto.EnrollRequest, ca: str | None,
         give_up: float) -> proto.EnrollAnswer | None:
    """One session: the answer to `request`, or None if the broker dropped the session first."""
    answers: list[proto.EnrollAnswer] = []
    arrived, subscribed, dropped = threading.Event(), threading.Event(), threading.Event()
    client = make_client(f"{token.device}-enroll-{secrets.token_hex(3)}", token.username, token.password,
                         reconnect_on_failure=False, tls_ca=ca)

    def on_message(c, u, msg) -> None:  # noqa: ANN001
        try:
            answer = proto.decode_answer(msg.payload)
        except Exception:  # noqa: BLE001 - anything unreadable is simply not an answer
            return
        if answer.nonce == request.nonce:  # another process's answer (same token) is not ours
            answers.append(answer)
            arrived.set()

    def on_disconnect(*args) -> None:  # noqa: ANN002
        dropped.set()
        subscribed.set()
        arrived.set()

    client.on_message = on_message
    client.on_subscribe = lambda *a: subscribed.set()
    client.on_disconnect = on_disconnect
    try:
        connect(client, token.host, token.port, timeout=CONNECT_TIMEOUT)
    except BrokerUnavailable as exc:
        if "Not authorized" in str(exc) or "Bad user name or password" in str(exc):
            raise _Refused() from None
        raise EnrollError(f"{exc}: check the network and that mosquitto is running on the server") from None
    try:
        client.subscribe(topics.enrolled(token.federation, token.device), qos=1)
        if not subscribed.wait(10):
            raise EnrollError("the broker did not confirm the subscription; try again")
        if dropped.is_set():
            return None
        client.publish(topics.enroll(token.federation, token.device), proto.encode("enroll", request), qos=1)
        if not arrived.wait(max(0.0, give_up - time.monotonic())):
            raise EnrollError(NO_ANSWER)
    finally:
        client.disconnect()
        client.loop_stop()
    return answers[0] if answers else None


def _accepted(host: str, port: int, device: str, password: str, ca: str | None) -> bool:
    client = make_client(f"{device}-check-{secrets.token_hex(3)}", device, password, reconnect_on_failure=False,
                         tls_ca=ca)
    try:
        connect(client, host, port, timeout=5)
    except BrokerUnavailable:
        return False
    client.disconnect()
    client.loop_stop()
    return True


def _verify(config_host: str, port: int, device: str, password: str, ca: str | None, within: float) -> None:
    """Connect with the new credentials; the broker may need a moment to reload its password file.
    (The broker lets one connection per device in, so this would drop a running agent's session;
    none runs with these credentials yet, and the service is restarted after enrolling.)"""
    give_up = time.monotonic() + within
    while not _accepted(config_host, port, device, password, ca):
        if time.monotonic() > give_up:
            raise EnrollError("enrolled, but the broker refused the new credentials: "
                              "ask the operator to run 'sudo systemctl reload mosquitto'")
        time.sleep(0.5)


def enroll(token_text: str, config_path: Path = DEFAULT_CONFIG, data: str | None = None,
           state_dir: str = DEFAULT_STATE_DIR, ca_file: Path | None = None, timeout: float = 30.0) -> Enrolled:
    try:
        token = proto.decode_token(token_text)
    except proto.TokenError as exc:
        raise EnrollError(str(exc)) from None
    if token.expired():
        when = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(token.expires))
        raise EnrollError(f"this token expired at {when}: ask the operator for a new one "
                          f"('broker-coordinator devices rotate {token.device}')")
    # absolute, so that the service (systemd starts it in /) and a run from another directory read
    # the same files the operator named here
    config_path = Path(config_path).absolute()
    state_dir = str(Path(state_dir).absolute())
    data = str(Path(data).absolute()) if data else None
    check_writable(config_path)
    ca = str(fetch_ca(token, ca_file, config_path.parent / "ca.crt")) if token.tls else None

    new_password = secrets.token_urlsafe(24)
    answer = _redeem(token, new_password, ca, timeout)
    if not answer.ok:
        hints = {"used": "ask the operator for a new token",
                 "expired": f"ask the operator for a new one ('broker-coordinator devices rotate {token.device}')",
                 "revoked": "this device was revoked; the operator must enroll it under a new name"}
        raise EnrollError(f"the coordinator refused the token ({answer.reason}: {answer.detail}): "
                          f"{hints.get(answer.reason, 'ask the operator')}")

    sections = {
        "broker": {"host": token.host, "port": token.port, "username": token.device, "password": new_password,
                   "tls_ca": ca or ""},
        "device": {"id": token.device, "federation": token.federation,
                   "data": data or str(Path(state_dir) / "data.npz"), "state_dir": state_dir,
                   "signing_key": token.signing_key},
    }
    atomic_write(config_path, "# Written by 'edge-agent enroll'. Holds this device's broker password and signing "
                 "key.\n" + to_toml(sections), 0o600)

    _verify(token.host, token.port, token.device, new_password, ca, within=15)
    return Enrolled(token.device, token.federation, token.host, token.port, token.tls, config_path)
