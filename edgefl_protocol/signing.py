"""Per-device update signatures: HMAC-SHA256 with the device's own key.

On the wire a signed message is

    b"EFS1" | HMAC-SHA256(key, payload) (32 bytes) | payload

so the receiver checks the tag with the key of the device named by the topic
(which the broker ACL ties to the sender's credentials) before it parses a
single byte of the payload. A misconfigured ACL therefore still cannot let
one device speak for another: it would need that device's key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import tomllib
from pathlib import Path

from .errors import Rejected
from .persist import atomic_write

MAGIC = b"EFS1"
TAG_BYTES = 32
KEY_BYTES = 32
MIN_KEY_BYTES = 16


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def key_from_hex(text: str) -> bytes:
    """A key as written in a config file (hex); ValueError says what is wrong."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError("signing_key must be hex digits (e.g. 64 of them for a 32-byte key)") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"signing_key must be at least {MIN_KEY_BYTES} bytes ({2 * MIN_KEY_BYTES} hex digits)")
    return key


def read_key_file(path: Path | str) -> dict[str, bytes]:
    """The coordinator's device -> key table: a TOML file of `device = "hex"` lines (missing file: empty).

    Enrollment writes it; `write_key_file` is the format."""
    path = Path(path)
    if not path.exists():
        return {}
    with open(path, "rb") as handle:
        table = tomllib.load(handle)
    keys = {}
    for device, text in table.items():
        if not isinstance(text, str):
            raise ValueError(f"{path}: key of {device!r} must be a hex string")
        try:
            keys[device] = key_from_hex(text)
        except ValueError as exc:
            raise ValueError(f"{path}: {device}: {exc}") from None
    return keys


def write_key_file(path: Path | str, keys: dict[str, bytes]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f'"{device}" = "{key.hex()}"\n' for device, key in sorted(keys.items()))
    atomic_write(path, text, 0o600)


def sign(payload: bytes, key: bytes) -> bytes:
    return MAGIC + hmac.new(key, payload, hashlib.sha256).digest() + payload


def verify(data: bytes, key: bytes | None, who: str = "sender") -> bytes:
    """The payload if the tag is right; otherwise Rejected('signature'). Parses nothing before that."""
    if key is None:
        raise Rejected("unknown_key", f"no signing key is registered for {who}")
    if not isinstance(data, (bytes, bytearray)) or len(data) < len(MAGIC) + TAG_BYTES or data[:4] != MAGIC:
        raise Rejected("signature", f"message from {who} is not signed (no {MAGIC.decode()} header)")
    tag, payload = bytes(data[4:4 + TAG_BYTES]), bytes(data[4 + TAG_BYTES:])
    if not hmac.compare_digest(tag, hmac.new(key, payload, hashlib.sha256).digest()):
        raise Rejected("signature", f"signature does not match {who}'s key")
    return payload
