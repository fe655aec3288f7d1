"""`simulate --sites N`: the federation in N sites on one machine, through the production parts.

A central Mosquitto and one Mosquitto per site, bridged with the generated configuration
(`local_sites.LocalSites`); the site aggregator workers (`site_aggregator.SiteWorker`, one per
site unless asked for more) run as threads of the simulation's process, each on its site broker;
devices are dealt to sites in turn and their agents connect to their site's broker. The
coordinator (`tree.TreeCoordinator`) connects to the central broker only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from broker_coordinator.engine.site_aggregator import SiteWorker
from broker_coordinator.engine.tree import SiteSpec
from broker_coordinator.simulation.local_sites import LocalSites


def deal(devices: list[str], sites: int) -> dict[str, list[str]]:
    """Devices to sites in turn: site-0 gets the 1st, (N+1)th, ... device."""
    if sites < 1:
        raise ValueError(f"--sites must be >= 1, got {sites}")
    if sites > len(devices):
        raise ValueError(f"--sites {sites} is more than the {len(devices)} devices: every site needs one")
    return {f"site-{k}": devices[k::sites] for k in range(sites)}


@dataclass
class SimulatedSites:
    workdir: Path
    federation: str
    arch: str
    where: dict[str, list[str]]  # site -> its devices
    keys: dict[str, bytes]  # device -> its signing key
    workers: int = 1
    rig: LocalSites | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _workers: list[SiteWorker] = field(default_factory=list)

    def start(self) -> "SimulatedSites":
        self.rig = LocalSites(self.workdir, self.federation, self.where, workers=self.workers).start()
        try:
            for site, devices in self.where.items():
                for index in range(self.workers):
                    worker = SiteWorker(self.federation, site, self.arch, self.rig.site_key(site),
                                        {d: self.keys[d] for d in devices}, index)
                    broker = self.rig.brokers[site]
                    worker.connect(broker.host, broker.port, *self.rig.worker_login(site, index))
                    self._workers.append(worker)
                    thread = threading.Thread(target=worker.serve, args=(self._stop,), daemon=True,
                                              name=f"site-worker-{site}-{index}")
                    thread.start()
                    self._threads.append(thread)
        except BaseException:
            self.stop()
            raise
        return self

    def specs(self) -> dict[str, SiteSpec]:
        assert self.rig is not None
        return {site: SiteSpec(self.workers, self.rig.site_key(site)) for site in self.where}

    def device_port(self, device: str) -> int:
        assert self.rig is not None
        site = next(s for s, devices in self.where.items() if device in devices)
        return self.rig.brokers[site].port

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        for worker in self._workers:
            worker.close()
        if self.rig is not None:
            self.rig.stop()
