"""Protocol versions: which ones this release speaks, how one is chosen per device, what changed.

Every message says its version in its header (`schema`). The policy:

- Within a version, a message may only gain fields that are optional, with a default that means what
  the message meant without them; readers ignore fields they do not know. Anything else (a field
  removed, renamed, made required or given another meaning, a message that must now be signed) makes
  a new version.
- A release speaks the current version and the previous one (`messages.SPOKEN`). The coordinator
  serves both unless the operator stops serving the previous one earlier (`[federation]
  min_protocol`); the release after next drops it.
- The coordinator talks to each device in the newest version both speak, from the versions the
  agent announces in its presence (`protocols`; an agent that announces none is 0.1.0's, version 1).
  The device answers a task in the task's version. What every device reads (model manifests, chunks,
  deltas, serving releases) is written in the oldest version the coordinator serves, and an agent's
  presence in the oldest version it speaks, so that a coordinator of the previous release reads it.
- A device whose agent speaks no version the coordinator serves is not tasked; the coordinator sends
  it one `UpgradeNotice` (a kind every release reads, in any version) saying what to install, and
  tells the operator once. An agent of 0.1.0 predates the notice: only the operator is told.

What changed:

- 2 (0.2.0): the coordinator signs what it sends to one device (tasks, receipts, the upgrade notice)
  with that device's key, as devices sign their answers (`signing`), so that neither a broker nor a
  bridge between them can put words in the coordinator's mouth; a version-2 message to a device that
  is not signed is refused.
- 1 (0.1.0): tasks and receipts unsigned, trusted because the broker's ACL lets only the coordinator
  write a device's task and receipt topics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from . import OLDEST_SCHEMA, messages, signing
from .errors import Rejected

SPOKEN = tuple(messages.SPOKEN)
SIGNED_FROM = 2  # the first version in which the coordinator signs what it sends to one device
FIRST_RELEASE = {1: "0.1.0", 2: "0.2.0"}  # the first release that speaks each version


@dataclass
class UpgradeNotice:
    """The coordinator to a device whose agent speaks no version it serves: what to install."""

    device: str
    speaks: str  # the versions the agent announced, e.g. "1,2"
    serves: str  # the versions the coordinator serves, e.g. "3,4"
    install: str  # e.g. "edgefl>=0.3.0"

    def text(self) -> str:
        return (f"the coordinator serves protocol version(s) {self.serves} and this agent speaks {self.speaks}: "
                f"install {self.install} on this device (docs/OPERATOR.md, 'Upgrading')")


def serves(min_protocol: int = OLDEST_SCHEMA) -> tuple[int, ...]:
    """The versions a coordinator serves: from `min_protocol` ([federation]) to the current one."""
    if min_protocol not in SPOKEN:
        raise ValueError(f"min_protocol must be one of {', '.join(map(str, SPOKEN))}, got {min_protocol}")
    return tuple(v for v in SPOKEN if v >= min_protocol)


def announced(profile: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The versions a device's presence says its agent speaks; (1,) for an agent that says none (0.1.0)."""
    text = (profile or {}).get("protocols")
    if not isinstance(text, str) or not text:
        return (1,)
    versions = []
    for part in text.split(","):
        part = part.strip()
        if part.isascii() and part.isdigit():
            versions.append(int(part))
    return tuple(sorted(set(versions))) or (1,)


def choose(device_speaks: tuple[int, ...], coordinator_serves: tuple[int, ...]) -> int | None:
    """The newest version both speak; None when they share none."""
    common = set(device_speaks) & set(coordinator_serves)
    return max(common) if common else None


def seal(kind: str, message: Any, version: int, key: bytes | None) -> bytes:
    """A message to one device in `version`: signed with its key from version 2 on."""
    payload = messages.encode(kind, message, version)
    if version < SIGNED_FROM:
        return payload
    if key is None:
        raise Rejected("unknown_key", f"no signing key for the device: cannot send a version-{version} {kind}")
    return signing.sign(payload, key)


def unseal(data: bytes, key: bytes | None, who: str = "the coordinator") -> bytes:
    """The payload of a message sent to this device: a signed one must verify with the device's key; an
    unsigned one must be of a version that was not signed (1)."""
    if bytes(data[:len(signing.MAGIC)]) == signing.MAGIC:
        return signing.verify(data, key, who)
    version = header(data).get("schema")
    if isinstance(version, int) and version >= SIGNED_FROM:
        raise Rejected("signature", f"an unsigned protocol-{version} message from {who}: from version "
                                    f"{SIGNED_FROM} on, what the coordinator sends a device is signed")
    return bytes(data)


def header(data: bytes) -> dict[str, Any]:
    """The packed message's map ({} when it is none): its kind and version, before a decoder reads it."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_map_len=messages.MAX_HEADER_FIELDS)
    except Exception:  # noqa: BLE001 - the decoder says what is wrong with it
        return {}
    return obj if isinstance(obj, dict) else {}


def what_to_install(device_speaks: tuple[int, ...], coordinator_serves: tuple[int, ...],
                    coordinator_release: str) -> str:
    """For an agent that shares no version with its coordinator: the release that would."""
    if max(device_speaks) < min(coordinator_serves):  # older than the coordinator serves
        return f"edgefl>={FIRST_RELEASE.get(min(coordinator_serves), coordinator_release)}"
    return f"edgefl=={coordinator_release}, the coordinator's release (or upgrade the coordinator)"


def upgrade_notice(device: str, device_speaks: tuple[int, ...], coordinator_serves: tuple[int, ...],
                   coordinator_release: str, key: bytes | None) -> bytes:
    """The notice, in the newest version the device speaks (any release reads this kind in any version)."""
    notice = UpgradeNotice(device, ",".join(map(str, device_speaks)), ",".join(map(str, coordinator_serves)),
                           what_to_install(device_speaks, coordinator_serves, coordinator_release))
    return seal("upgrade", notice, max(device_speaks), key)


def decode_upgrade(data: bytes, max_bytes: int = 4096) -> UpgradeNotice:
    obj = messages.unpack(data, "upgrade", max_bytes)
    fields = {name: messages.typed_field(obj, name, str)[:messages.MAX_STRING]
              for name in ("device", "speaks", "serves", "install")}
    return UpgradeNotice(**fields)

