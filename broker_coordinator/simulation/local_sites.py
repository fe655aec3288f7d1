"""A federation in sites on one machine: a central Mosquitto and one Mosquitto per site, bridged
with the generated `connection` blocks (`sites`), each on a free loopback port with credentials
and ACLs. For tests and benchmarks; the bridges run without TLS on loopback. Use as a context
manager: it stops exactly the brokers it started."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.access.sites import (
    bridge_password,
    central_users,
    render_bridge,
    render_central_acl,
    render_worker_acl,
    site_key,
    worker_password,
    worker_user,
)
from broker_coordinator.simulation.private_broker import PrivateBroker


@dataclass
class LocalSites:
    workdir: Path
    federation: str
    sites: dict[str, list[str]]  # site -> its device ids
    workers: int = 1  # aggregator workers per site
    sys_interval: int = 0  # > 0: the central broker publishes $SYS counters this often (seconds)
    central_users_extra: dict[str, str] = field(default_factory=dict)  # more users of the central broker...
    central_acl_extra: str = ""  # ...and their ACL blocks
    coordinator_password: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    central: PrivateBroker | None = None
    brokers: dict[str, PrivateBroker] = field(default_factory=dict)
    passwords: dict[str, str] = field(default_factory=dict)  # device -> its broker password

    def start(self) -> "LocalSites":
        names = sorted(self.sites)
        self.central = PrivateBroker(self.workdir / "central", self.federation,
                                     users={COORDINATOR_USER: self.coordinator_password,
                                            **central_users(self.coordinator_password, names),
                                            **self.central_users_extra},
                                     extra_acl=render_central_acl(self.federation, names) + self.central_acl_extra,
                                     extra_conf=f"sys_interval {self.sys_interval}\n" if self.sys_interval else "")
        try:
            self.central.start()
            for site in names:
                broker = PrivateBroker(self.workdir / site, self.federation,
                                       extra_acl=render_worker_acl(self.federation, site, self.workers),
                                       extra_conf=render_bridge(self.federation, site, self.central.host,
                                                                self.central.port,
                                                                bridge_password(self.coordinator_password, site)))
                for device in self.sites[site]:
                    self.passwords[device] = broker.add_user(device)
                for w in range(self.workers):
                    broker.users[worker_user(site, w)] = worker_password(self.coordinator_password, site)
                self.brokers[site] = broker.start()
        except BaseException:
            self.stop()
            raise
        return self

    def site_key(self, site: str) -> bytes:
        return site_key(self.coordinator_password, site)

    def worker_login(self, site: str, worker: int) -> tuple[str, str]:
        return worker_user(site, worker), worker_password(self.coordinator_password, site)

    def stop(self) -> None:
        for broker in self.brokers.values():
            broker.stop()
        if self.central:
            self.central.stop()

    def __enter__(self) -> "LocalSites":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
