"""One `[sites.NAME]` table of the coordinator's config: which devices a site holds and where its
broker is (`access.sites` renders its files from it)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from edgefl_protocol import topics


@dataclass
class SiteSettings:
    """One `[sites.NAME]` table of the coordinator's config."""

    name: str
    devices: str  # comma-separated glob patterns over device ids, e.g. "north-*,pi-07"
    workers: int = 1  # aggregator processes sharing the site's updates ($share)
    host: str = "127.0.0.1"  # where the site's devices and workers reach the site broker
    port: int = 1883  # the site broker's listener
    bind: str = ""  # "" = all interfaces
    bridge_tls: str = "auto"  # auto (TLS when the central broker has TLS) | on | off
    bridge_cafile: str = ""  # CA of the central broker's certificate; "" = [broker] tls_ca or tls_cert
    out_dir: str = ""  # where broker-config --site writes; "" = /etc/edgefl/sites/<name>
    run_as: str = ""  # the site Mosquitto's `user` when started as root; "" = its default (mosquitto),
    # which must be able to read the written files (they are owned like their directory)

    def validate(self) -> None:
        topics.check_name("site", self.name)
        if not self.patterns:
            raise ValueError("devices must name at least one glob pattern, e.g. \"north-*\"")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be 1-64, got {self.workers}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.bridge_tls not in ("auto", "on", "off"):
            raise ValueError(f"bridge_tls must be auto, on or off, got {self.bridge_tls!r}")

    @property
    def patterns(self) -> list[str]:
        return [p.strip() for p in self.devices.split(",") if p.strip()]

    def holds(self, device: str) -> bool:
        return any(fnmatch.fnmatchcase(device, p) for p in self.patterns)
