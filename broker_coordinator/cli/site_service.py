"""`broker-coordinator site-aggregator --config aggregator.toml [--worker I]`: one worker of a
site, until SIGTERM. The config is written by `broker-config --site NAME`:

    [site]
    name = "north"
    federation = "default"
    model = "mnist_cnn"
    workers = 1                  # how many workers share the site's updates; --worker is 0..workers-1
    key = "..."                  # hex: signs the site's partials (derived from the coordinator's secret)
    device_keys = "/etc/edgefl/sites/north/device_keys.toml"
    share_group = "edgefl"       # the $share group of the workers
    seed = 0

    [broker]                     # the site broker
    host = "127.0.0.1"
    port = 1883
    password = "..."             # worker I logs in as <name>-aggregator-<I>
    tls_ca = ""                  # set when the site broker's listener speaks TLS

Environment overrides: EDGEFL_SITE_<SECTION>_<KEY>.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from broker_coordinator.access.sites import worker_user
from edgefl_protocol import signing, topics
from edgefl_protocol.settings import ConfigError, build_section, read_toml

ENV_PREFIX = "EDGEFL_SITE"


@dataclass
class SiteSection:
    name: str
    federation: str
    key: str
    device_keys: str
    model: str = "mnist_cnn"
    workers: int = 1
    share_group: str = "edgefl"
    seed: int = 0

    def validate(self) -> None:
        topics.check_name("site", self.name)
        topics.check_name("federation", self.federation)
        signing.key_from_hex(self.key)
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be 1-64, got {self.workers}")
        topics.check_name("share_group", self.share_group)


@dataclass
class SiteBroker:
    password: str
    host: str = "127.0.0.1"
    port: int = 1883
    tls_ca: str = ""

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")


def load_site_config(path: Path | str) -> tuple[SiteSection, SiteBroker]:
    raw = read_toml(path)
    unknown = set(raw) - {"site", "broker"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}; expected site, broker")
    return (build_section(SiteSection, raw.get("site", {}), f"{path} [site]", f"{ENV_PREFIX}_SITE"),
            build_section(SiteBroker, raw.get("broker", {}), f"{path} [broker]", f"{ENV_PREFIX}_BROKER"))


def run(path: Path | str, worker: int, echo: Callable[[str], None] = print) -> int:
    from broker_coordinator.engine.site_aggregator import SiteWorker  # imports torch
    site, broker = load_site_config(path)
    if not 0 <= worker < site.workers:
        raise ConfigError(f"--worker {worker}: the site has workers 0-{site.workers - 1} ([site] workers)")
    try:
        keys = signing.read_key_file(site.device_keys)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    aggregator = SiteWorker(site.federation, site.name, site.model, signing.key_from_hex(site.key), keys,
                            worker, site.share_group, site.seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    aggregator.connect(broker.host, broker.port, worker_user(site.name, worker), broker.password,
                       tls_ca=broker.tls_ca or None)
    echo(f"site {site.name}: aggregator worker {worker} of {site.workers} on {broker.host}:{broker.port}, "
         f"{len(keys)} device keys")
    try:
        aggregator.serve(stop)
    finally:
        aggregator.close()
    echo(f"site {site.name}: worker {worker} stopped after {aggregator.partials_sent} partials")
    return 0
