"""Which devices are online, idle and admitted: a mixin of `Coordinator`.

Presence is learnt from the devices' retained statuses (online with their
hardware profile and whether they are busy; offline by their will). A device
tasked for a round is not selected again until its status says it is idle and
done with that round, or the round's deadline has passed. Only devices the
registry admits are ever selected, since anyone enrolled could leave a status.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from broker_coordinator.engine.rounds import RoundFailed
from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected

log = logging.getLogger("broker_coordinator")
PRESENCE_FLUSH = 1.0  # seconds a buffered status waits at most while messages keep arriving


class DevicePresence:
    """Uses the coordinator's online, pending_until, pending_round, admission, store, metrics and _drain."""

    def _on_status(self, device: str, payload: bytes) -> None:
        if not payload:  # its retained status cleared (`devices revoke` and `rotate` do, the broker sends no will)
            self.online.pop(device, None)
            if self.store:
                self.store.record_presence(device, False, {})
            return
        try:
            status = messages.decode_status(payload)
        except Rejected as exc:
            log.warning("status from %s ignored: %s", device, exc)
            return
        if status.state == "online":
            self.online[device] = dict(status.profile)
            last_round = status.profile.get("last_round", 0)
            if (not status.profile.get("busy") and isinstance(last_round, int)
                    and last_round >= self.pending_round.get(device, 0)):
                # idle and done with the round it was tasked for (even if its answer was lost): free again
                self.pending_until.pop(device, None)
        else:
            self.online.pop(device, None)
            self.pending_until.pop(device, None)
        if self.store:
            self.store.record_presence(device, status.state == "online", dict(status.profile))
        self.metrics.online.set(len(self.online))

    def _flush_presence(self, quiet: bool) -> None:
        """The store buffers statuses: write them in one transaction when the inbox is quiet, and once
        a second while a stream of them (a reconnect's retained statuses) keeps arriving."""
        if self.store:
            self.store.flush_presence(older_than=0.0 if quiet else PRESENCE_FLUSH)

    def eligible(self) -> list[str]:
        """Online devices that are not busy with an earlier task and that the registry admits."""
        now = time.time()
        self.pending_until = {d: t for d, t in self.pending_until.items() if t > now}
        return [d for d, profile in self.online.items()
                if not profile.get("busy") and d not in self.pending_until and self._is_admitted(d)]

    def _is_admitted(self, device: str) -> bool:
        """Presence comes from retained statuses anyone enrolled could have left: only devices the
        registry admits (active, not revoked) are selected. Answers are cached for a few seconds."""
        if self.admission is None:
            return True
        when, admitted = self._admitted
        if time.monotonic() - when > 5.0 or admitted is None:
            admitted = {d for d in self.online if self.admission(d) is None}
            self._admitted = (time.monotonic(), admitted)
        return device in admitted

    def _settle_presence(self, quiet: float = 0.5, limit: float = 5.0) -> None:
        """After (re)connecting, read the retained statuses until they stop arriving, so the first
        cohort is chosen from every device that is online, not from the first few to be heard."""
        give_up, last = time.monotonic() + limit, len(self.online)
        quiet_since = time.monotonic()
        while time.monotonic() < give_up and time.monotonic() - quiet_since < quiet:
            self._drain(0.1)
            if len(self.online) != last:
                last, quiet_since = len(self.online), time.monotonic()
        self._presence_settled = True

    def wait_for_devices(self, count: int, timeout: float, progress: Callable[[int, int], None] | None = None) -> None:
        give_up = time.monotonic() + timeout
        last_seen = -1
        while len(self.eligible()) < count:
            if self.stopping.is_set():
                raise RoundFailed("shutting down")
            if time.monotonic() > give_up:
                raise TimeoutError(f"only {len(self.eligible())} of {count} devices were online and idle "
                                   f"within {timeout:.0f} s")
            if progress and len(self.online) != last_seen:
                last_seen = len(self.online)
                progress(last_seen, count)
            self._drain(0.2)
        if progress:
            progress(len(self.online), count)
