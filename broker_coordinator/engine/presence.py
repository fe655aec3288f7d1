"""Which devices (or sites) are online, idle and admitted.

Presence is learnt from the devices' retained statuses (online with their
hardware profile and whether they are busy; offline by their will). A device
tasked for a round is not selected again until its status says it is idle and
done with that round, or the round's deadline has passed. Only devices the
registry admits are ever selected, since anyone enrolled could leave a status. A device whose
owner's conditions keep it from training now (hours, load, temperature, CPU-seconds a day:
edge_agent/conditions.py) says `eligible: false` and `why` in its status and is not selected;
a status without the key (an agent of the previous release) is eligible. A device whose agent speaks
no protocol version the coordinator serves (`edgefl_protocol.protocol`) is not selected either; the
intake's `DeviceWire` hears each online status and tells such a device, once, what to install.

In a federation in sites the centre's units are sites: `SitePresence` reads the
status each site's leader publishes (its online and eligible device counts).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.storage.store import Store
from edgefl_protocol import messages, protocol
from edgefl_protocol.errors import Rejected
from edgefl_protocol.version import UNKNOWN, release

log = logging.getLogger("broker_coordinator")
PRESENCE_FLUSH = 1.0  # seconds a buffered status waits at most while messages keep arriving

# device -> None (admitted) or (reason, detail); e.g. Registry.admission, which rejects unknown and
# revoked devices. None: every device the broker lets in is admitted (simulate).
Admission = Callable[[str], "tuple[str, str] | None"]


class DevicePresence:
    def __init__(self, store: Store | None, metrics: Metrics, admission: Admission | None = None,
                 serves: tuple[int, ...] = protocol.SPOKEN) -> None:
        self.store, self.metrics, self.admission, self.serves = store, metrics, admission, serves
        self.on_online: Callable[[str, dict[str, Any]], Any] | None = None  # each online status (DeviceWire.heard)
        self.online: dict[str, dict[str, Any]] = {}
        self.pending_until: dict[str, float] = {}  # tasked devices that have not answered yet
        self.pending_round: dict[str, int] = {}
        self._admitted: tuple[float, set[str] | None] = (0.0, None)  # (when, devices the registry admits)
        self._versions_seen: set[str] = set()  # agent releases with a Prometheus series

    def on_status(self, device: str, payload: bytes) -> None:
        if not payload:  # its retained status cleared (`devices revoke` and `rotate` do, the broker sends no will)
            self.online.pop(device, None)
            self._device_series(device)
            if self.store:
                self.store.record_presence(device, False, {})
            self.metrics.online.set(len(self.online))
            self._count_versions()
            return
        try:
            status = messages.decode_status(payload)
        except Rejected as exc:
            log.warning("status from %s ignored: %s", device, exc)
            return
        if status.state == "online":
            self.online[device] = dict(status.profile)
            if self.on_online is not None:
                self.on_online(device, self.online[device])
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
        self._count_versions()
        self._device_series(device)

    def _device_series(self, device: str) -> None:
        profile = self.online.get(device)
        self.metrics.device_online.labels(device).set(profile is not None)
        self.metrics.device_eligible.labels(device).set(
            profile is not None and ineligible_because(profile, self.serves) is None)

    def _count_versions(self) -> None:
        """Prometheus' `edgefl_agents{version}`: the online devices by the release their agent runs."""
        counts = Counter(str(p.get("agent") or UNKNOWN) for p in self.online.values())
        for version in self._versions_seen - set(counts):
            self.metrics.agents.labels(version).set(0)
        for version, n in counts.items():
            self.metrics.agents.labels(version).set(n)
        self._versions_seen |= set(counts)

    def tasked(self, devices: set[str] | list[str], round_no: int, deadline: float) -> None:
        """Busy with a task until it answers, its status says it is done, or the deadline."""
        for device in devices:
            self.pending_until[device] = deadline
            self.pending_round[device] = round_no

    def flush(self, quiet: bool) -> None:
        """The store buffers statuses: write them in one transaction when the inbox is quiet, and once
        a second while a stream of them (a reconnect's retained statuses) keeps arriving."""
        if self.store:
            self.store.flush_presence(older_than=0.0 if quiet else PRESENCE_FLUSH)

    def eligible(self) -> list[str]:
        """Online devices that may train now by their own conditions, are not busy with an earlier
        task, and that the registry admits."""
        now = time.time()
        self.pending_until = {d: t for d, t in self.pending_until.items() if t > now}
        return [d for d, profile in self.online.items()
                if not profile.get("busy") and ineligible_because(profile, self.serves) is None
                and d not in self.pending_until and self._is_admitted(d)]

    def not_eligible(self) -> dict[str, str]:
        """Online devices whose own conditions keep them from training now, with why."""
        return {d: why for d, profile in self.online.items() if (why := ineligible_because(profile, self.serves))}

    def eligible_devices(self) -> int:
        return len(self.eligible())

    def population(self) -> int:
        return len(self.online)

    def samples(self) -> int:
        """Training samples the online devices hold, as their presence reports them."""
        return sum(count_of(p, "samples") for p in self.online.values())

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


class SitePresence:
    """The sites online, from the statuses their leaders keep retained (`site_aggregator`)."""

    def __init__(self) -> None:
        self.online: dict[str, dict[str, Any]] = {}

    def on_status(self, site: str, payload: bytes) -> None:
        try:
            status = messages.decode_status(payload) if payload else None
        except Rejected as exc:
            log.warning("status of site %s ignored: %s", site, exc)
            return
        if status is None or status.state != "online":
            self.online.pop(site, None)
        else:
            self.online[site] = dict(status.profile)

    def flush(self, quiet: bool) -> None:
        """Site statuses are not stored."""

    def eligible(self) -> list[str]:
        """Sites online with at least one eligible device."""
        return [s for s, p in self.online.items() if count_of(p, "eligible") > 0]

    def eligible_devices(self) -> int:
        return sum(count_of(self.online[site], "eligible") for site in self.eligible())

    def population(self) -> int:
        return sum(count_of(p, "online") for p in self.online.values())

    def samples(self) -> int:
        """Training samples the sites' online devices hold, as each site's leader reports them."""
        return sum(count_of(p, "samples") for p in self.online.values())


def parse_profile(profile: Mapping[str, Any] | str | None) -> Mapping[str, Any]:
    """A status profile, or the JSON text of one the store keeps ({} for anything else)."""
    if isinstance(profile, str):
        try:
            profile = json.loads(profile)
        except ValueError:
            return {}
    return profile if isinstance(profile, Mapping) else {}


def agent_release(profile: Mapping[str, Any] | str | None) -> str:
    """The release a device's agent says it runs (from its status profile, or the store's JSON text)."""
    value = parse_profile(profile).get("agent")
    return value if isinstance(value, str) and value else UNKNOWN


def ineligible_because(profile: Mapping[str, Any] | str | None,
                       serves: tuple[int, ...] = protocol.SPOKEN) -> str | None:
    """Why a device's status profile (or the JSON text of one the store keeps) says it may not train
    now (`eligible` false, and its `why`), or that its agent speaks no protocol version `serves` holds;
    None when it may."""
    profile = parse_profile(profile)
    speaks = protocol.announced(profile)
    if protocol.choose(speaks, serves) is None:
        return (f"its agent speaks protocol {','.join(map(str, speaks))}, the coordinator serves "
                f"{','.join(map(str, serves))}: install {protocol.what_to_install(speaks, serves, release())} on it")
    if profile.get("eligible") is not False:
        return None
    why = profile.get("why")
    return why if isinstance(why, str) and why else "its own conditions (it gave no reason)"


def count_of(profile: Mapping[str, Any], key: str) -> int:
    value = profile.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
