"""What the coordinator says to one device, in the protocol version that device speaks.

Each device announces the versions its agent speaks in its presence (`protocols`; none: 0.1.0, version
1). Tasks and receipts go out in the newest version it shares with the coordinator's
(`edgefl_protocol.protocol`: from version 2 on signed with the device's key). A device that shares
none is not selected (presence says why), is sent one upgrade notice naming what to install (an agent
of 0.1.0 cannot read it), and the operator is told once at WARNING: someone must upgrade it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from edgefl_protocol import protocol, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.version import release

log = logging.getLogger("broker_coordinator")


class DeviceWire:
    def __init__(self, fed: str, key_of: Callable[[str], bytes | None], serves: tuple[int, ...],
                 send: Callable[[str, bytes], Any]) -> None:
        self.fed, self.key_of, self.serves, self.send = fed, key_of, serves, send
        self.spoken: dict[str, int] = {}  # device -> the version last chosen for it (kept while it is offline)
        self._told: dict[str, tuple[int, ...]] = {}  # device -> what it spoke when it was told to upgrade

    def heard(self, device: str, profile: Mapping[str, Any]) -> int | None:
        """A device's presence: the version to speak to it, or None (and, once, the upgrade notice)."""
        speaks = protocol.announced(profile)
        chosen = protocol.choose(speaks, self.serves)
        if chosen is not None:
            self.spoken[device] = chosen
            self._told.pop(device, None)
            return chosen
        if self._told.get(device) != speaks:
            self._told[device] = speaks
            self._tell(device, speaks, "protocols" in profile)
        return None

    def _tell(self, device: str, speaks: tuple[int, ...], reads_notices: bool) -> None:
        install = protocol.what_to_install(speaks, self.serves, release())
        log.warning("%s runs an agent that speaks protocol version(s) %s; this coordinator serves %s: it is not "
                    "selected until you install %s on it (docs/OPERATOR.md, 'Upgrading')", device,
                    ",".join(map(str, speaks)), ",".join(map(str, self.serves)), install)
        if not reads_notices:  # 0.1.0 announces nothing and reads no notice
            return
        try:
            notice = protocol.upgrade_notice(device, speaks, self.serves, release(), self.key_of(device))
        except Rejected as exc:
            log.info("no upgrade notice for %s: %s", device, exc)
            return
        self.send(topics.receipt(self.fed, device), notice)

    def version(self, device: str) -> int:
        """The version to write to `device` in: the one chosen from its presence, else the oldest served."""
        return self.spoken.get(device, min(self.serves))

    def seal(self, device: str, kind: str, message: Any) -> bytes | None:
        """`message` for `device` in its version; without its key (an unknown device's answer), unsigned in
        version 1 when that is served, else None: nothing can be said to it."""
        key = self.key_of(device)
        version = self.version(device)
        if key is None and version >= protocol.SIGNED_FROM:
            if min(self.serves) >= protocol.SIGNED_FROM:
                return None
            version = min(self.serves)
        return protocol.seal(kind, message, version, key)
