"""Enrollment: the one-time token and the two messages of the enrollment handshake.

A token is printed by `broker-coordinator devices add NAME` and pasted into
`edge-agent enroll TOKEN` on the device:

    edgefl1.<base64url msgpack payload>.<base64url checksum>

The payload carries what the device needs: broker address and port, TLS flag
and CA fingerprint, federation, device id, a *one-time* broker password, the
update-signing key, the token id and its expiry. The checksum (6 bytes of
SHA-256) only catches copy-paste damage; the token is a secret, not a
certificate.

Single use is enforced by the coordinator, not by the token: the one-time
password works only while the device is `pending` in the registry. On enroll
the device connects with it, sends `EnrollRequest` (token id and a password
it generated itself) on its own `enroll` topic; the coordinator checks the
token id and expiry, stores the new password's hash, marks the token used,
answers `EnrollAnswer` on the device's `enrolled` topic, and reloads the
broker, which drops the one-time password. A second use of the token is then
refused by the broker itself.

Each request carries a random nonce that its answer echoes: two processes
redeeming one token at the same moment both see both answers on the shared
`enrolled` topic, and each takes only its own (the loser's says `used`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from dataclasses import asdict, dataclass

import msgpack

from . import OLDEST_SCHEMA
from .errors import Rejected
from .messages import typed_field, unpack
from .topics import check_name

TOKEN_PREFIX = "edgefl1"
_CHECK_BYTES = 6


class TokenError(ValueError):
    """A token that cannot be used; the message says why and what to do."""


@dataclass
class EnrollmentToken:
    device: str
    federation: str
    host: str
    port: int
    password: str  # one-time: valid only until the device enrolls (or the token expires)
    signing_key: str  # hex, per device (HMAC-SHA256 key for updates)
    token_id: str
    expires: float  # unix seconds
    tls: bool = False
    ca_sha256: str = ""  # hex SHA-256 of the CA certificate (DER) when tls

    @property
    def username(self) -> str:
        return self.device

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_token(token: EnrollmentToken) -> str:
    payload = msgpack.packb(asdict(token), use_bin_type=True)
    check = hashlib.sha256(payload).digest()[:_CHECK_BYTES]
    return f"{TOKEN_PREFIX}.{_b64(payload)}.{_b64(check)}"


def decode_token(text: str) -> EnrollmentToken:
    """Parse and check a token; raise TokenError (never anything else) if it is unusable."""
    garbled = TokenError("the enrollment token is garbled: copy the whole line printed by "
                         "'broker-coordinator devices add' (or get a new one with 'devices rotate NAME')")
    parts = text.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise garbled
    try:
        payload, check = _unb64(parts[1]), _unb64(parts[2])
    except (binascii.Error, ValueError):
        raise garbled from None
    if hashlib.sha256(payload).digest()[:_CHECK_BYTES] != check:
        raise garbled
    try:
        raw = msgpack.unpackb(payload, raw=False, max_map_len=32)
        token = EnrollmentToken(**raw)
        check_name("device", token.device)
        check_name("federation", token.federation)
        if not (isinstance(token.port, int) and 0 < token.port < 65536 and isinstance(token.expires, (int, float))):
            raise ValueError("bad port or expiry")
        bytes.fromhex(token.signing_key)
    except (TypeError, ValueError, msgpack.UnpackException):
        raise garbled from None
    return token


@dataclass
class EnrollRequest:
    """Device -> coordinator, on the device's own `enroll` topic, signed in with the one-time password."""

    device: str
    token_id: str
    password: str  # the device's new broker password, generated on the device
    nonce: str = ""  # random, per request; the answer echoes it


@dataclass
class EnrollAnswer:
    """Coordinator -> device, on the device's own `enrolled` topic."""

    device: str
    ok: bool
    reason: str = ""  # "", "used", "expired", "unknown_device", "revoked", "bad_request"
    detail: str = ""
    nonce: str = ""  # the request's


def encode(kind: str, message: EnrollRequest | EnrollAnswer) -> bytes:
    # the oldest protocol: a device of any release this one serves enrolls, and an agent enrolls with a coordinator
    # of the previous release
    return msgpack.packb({"schema": OLDEST_SCHEMA, "kind": kind, **asdict(message)}, use_bin_type=True)


def decode_request(data: bytes) -> EnrollRequest:
    obj = unpack(data, "enroll", 4096)
    request = EnrollRequest(typed_field(obj, "device", str), typed_field(obj, "token_id", str),
                            typed_field(obj, "password", str), _nonce(obj))
    if not 16 <= len(request.password) <= 256:
        raise Rejected("schema", "the new password must be 16-256 characters")
    return request


def decode_answer(data: bytes) -> EnrollAnswer:
    obj = unpack(data, "enrolled", 4096)
    return EnrollAnswer(typed_field(obj, "device", str), typed_field(obj, "ok", bool), typed_field(obj, "reason", str),
                        typed_field(obj, "detail", str), _nonce(obj))


def _nonce(obj: dict) -> str:
    """Missing in messages from before nonces: "" (which matches no request of a current agent)."""
    nonce = obj.get("nonce", "")
    if not isinstance(nonce, str) or len(nonce) > 64:
        raise Rejected("schema", "field 'nonce' must be a string of at most 64 characters")
    return nonce
