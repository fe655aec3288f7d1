"""The enrollment desk: redeems one-time tokens over MQTT (see edgefl_protocol.enrollment).

A device that runs `edge-agent enroll TOKEN` signs in with the token's one-time
password and publishes an `EnrollRequest` (token id, a new password it made
itself) on `edgefl/<fed>/device/<id>/enroll`. The desk:

  1. redeems the token in the registry in one UPDATE (pending, same token id,
     not expired -> active, new password hash); anything else is refused with
     a reason (used, expired, revoked, unknown_device);
  2. answers on `edgefl/<fed>/device/<id>/enrolled` and waits for the PUBACK;
  3. regenerates the password file (now holding the new hash) and reloads the
     broker, which drops the one-time password: the same token then fails at
     the broker's door.

The desk also removes expired one-time passwords: the password file holds a
pending device's one-time password only until its token expires, so at the
earliest expiry (a timer; every `rescan` seconds it looks at the registry's change
counter, so a token added since re-arms it) it regenerates the file and reloads
the broker.

The desk rides on any connected coordinator client (`attach`), so the round
loop's process can host it; `broker-coordinator serve-enrollment` runs it alone.
Work happens on one worker thread, never on paho's network thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from broker_coordinator.access.broker import BrokerError, hash_password, verify_password
from broker_coordinator.access.devices import apply
from broker_coordinator.access.registry import ACTIVE, PENDING, Registry, RegistryError
from broker_coordinator.settings.config import CoordinatorConfig
from edgefl_protocol import enrollment as proto
from edgefl_protocol import topics
from edgefl_protocol.errors import Rejected

log = logging.getLogger("broker_coordinator.access.enrollment")


class EnrollmentDesk:
    def __init__(self, config: CoordinatorConfig, registry: Registry,
                 apply_changes: Callable[[], str] | None = None, echo: Callable[[str], None] | None = None,
                 on_enrolled: Callable[[str], None] | None = None, rescan: float = 0.5) -> None:
        self.config = config
        # seconds between looks at the registry's change counter (one PRAGMA, no read): a token added
        # or changed since re-arms the timer to the earliest expiry
        self.rescan = rescan
        self._seen_version: int | None = None
        self._next_expiry: float | None = None
        self.expired: set[tuple[str, str]] = set()  # (device, token id) whose one-time password is gone
        self.on_enrolled = on_enrolled
        self.registry = registry
        self.fed = config.federation.name
        self.apply_changes = apply_changes or (lambda: apply(config, registry))
        self.echo = echo or log.info
        self.requests: queue.Queue = queue.Queue(maxsize=256)
        self.client = None
        self.worker = threading.Thread(target=self._work, name="enrollment-desk", daemon=True)
        self.stopping = threading.Event()

    def attach(self, client) -> None:  # noqa: ANN001 - a connected paho client of the coordinator user
        self.client = client
        client.message_callback_add(topics.all_enrolls(self.fed), self._on_request)
        client.subscribe(topics.all_enrolls(self.fed), qos=1)
        previous = client.on_connect

        def resubscribe(c, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
            if previous:
                previous(c, userdata, flags, reason_code, properties)
            if not reason_code.is_failure:
                c.subscribe(topics.all_enrolls(self.fed), qos=1)

        client.on_connect = resubscribe
        self.worker.start()

    def stop(self) -> None:
        self.stopping.set()
        self.requests.put(None)
        self.worker.join(timeout=10)

    def _on_request(self, client, userdata, msg) -> None:  # noqa: ANN001 - paho's network thread
        try:
            self.requests.put_nowait((msg.topic, msg.payload))
        except queue.Full:
            log.warning("enrollment queue full; dropped a request on %s", msg.topic)

    def _work(self) -> None:
        while not self.stopping.is_set():
            try:
                self._expire_if_due()
            except Exception:  # noqa: BLE001 - e.g. the registry briefly locked: try again at the next wake
                log.exception("checking for expired enrollment tokens failed")
            try:
                item = self.requests.get(timeout=self._until_next_look())
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                self.handle(*item)
            except Exception:  # noqa: BLE001 - one bad request must not stop the desk
                log.exception("enrollment request on %s failed", item[0])

    def _expire_if_due(self) -> None:
        """At the earliest token expiry, or when the registry changed (a token added, rotated or
        redeemed by another process): drop what expired and re-arm the timer to the next expiry."""
        version = self.registry.data_version()
        due = self._next_expiry is not None and time.time() >= self._next_expiry
        if version == self._seen_version and not due:
            return
        self.expire_tokens()
        now = time.time()
        self._next_expiry = min((d.token_expires for d in self.registry.devices(self.fed) if d.token_valid(now)),
                                default=None)
        self._seen_version = self.registry.data_version()

    def _until_next_look(self) -> float:
        if self._next_expiry is None:
            return self.rescan
        return max(0.05, min(self.rescan, self._next_expiry - time.time() + 0.05))

    def expire_tokens(self) -> list[str]:
        """Drop the one-time passwords of tokens that expired since the last look; return those devices."""
        now = time.time()
        expired = {(d.name, d.token_id or "") for d in self.registry.devices(self.fed)
                   if d.state == PENDING and d.token_expires is not None and d.token_expires <= now}
        listed = _password_file_users(self.config.broker.passwd_file)
        self.expired |= {e for e in expired if listed is not None and e[0] not in listed}  # already gone
        fresh = sorted(expired - self.expired)
        if not fresh:
            return []
        try:
            note = self.apply_changes()  # the password file leaves expired tokens out (Registry.broker_users)
        except BrokerError as exc:
            log.error("enrollment tokens of %s expired, but their one-time passwords are still in the "
                      "broker's password file: %s", ", ".join(name for name, _ in fresh), exc)
            return []
        self.expired |= set(fresh)
        for name, _ in fresh:
            self.echo(f"the enrollment token of {name} expired; its one-time password was removed ({note}): "
                      f"'broker-coordinator devices rotate {name}' makes a new one")
        return [name for name, _ in fresh]

    def handle(self, topic: str, payload: bytes) -> proto.EnrollAnswer:
        parsed = topics.parse_device_topic(topic)
        device = parsed[1] if parsed else "?"
        nonce = ""
        try:
            request = proto.decode_request(payload)
            nonce = request.nonce  # every answer echoes it: the device tells its answer from another's
            if request.device != device:
                raise Rejected("bad_request", f"topic says {device}, request says {request.device}")
            self.registry.activate(device, request.token_id, hash_password(request.password))
        except Rejected as exc:
            answer = proto.EnrollAnswer(device, False, "bad_request", exc.detail, nonce)
        except RegistryError as exc:
            if self._redeemed_by(device, request):  # a retry of the request that won: same answer again
                return self._answer(proto.EnrollAnswer(device, True, nonce=nonce))
            reason, _, detail = str(exc).partition(": ")
            answer = proto.EnrollAnswer(device, False, reason, detail, nonce)
        else:
            answer = proto.EnrollAnswer(device, True, nonce=nonce)
        self._answer(answer)
        if answer.ok:
            if self.on_enrolled:
                self.on_enrolled(device)
            time.sleep(0.2)  # let the answer reach the device before its one-time session is dropped
            try:
                note = self.apply_changes()
            except BrokerError as exc:
                log.error("%s enrolled, but: %s", device, exc)
            else:
                self.echo(f"{device} enrolled; {note}")
        else:
            self.echo(f"enrollment of {device} refused: {answer.reason}: {answer.detail}")
        return answer

    def _answer(self, answer: proto.EnrollAnswer) -> proto.EnrollAnswer:
        info = self.client.publish(topics.enrolled(self.fed, answer.device), proto.encode("enrolled", answer), qos=1)
        try:
            info.wait_for_publish(timeout=10)
        except (RuntimeError, ValueError):
            log.warning("answer to %s not confirmed by the broker", answer.device)
        return answer

    def _redeemed_by(self, device: str, request: proto.EnrollRequest) -> bool:
        """Is `device` active with this request's password? (the device lost its session, e.g. to a second
        `edge-agent enroll` with the same token, before the answer reached it, and asks again)"""
        current = self.registry.get(device)
        return current is not None and current.state == ACTIVE and verify_password(request.password,
                                                                                   current.password_hash)


def _password_file_users(path: str) -> set[str] | None:
    """The user names in Mosquitto's password file, or None if it cannot be read."""
    try:
        return {line.split(":", 1)[0] for line in Path(path).read_text().splitlines() if ":" in line}
    except OSError:
        return None
