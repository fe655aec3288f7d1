"""What `broker-coordinator broker-config --site NAME` writes: one directory with everything the
site's machine needs (see `sites` for the files and the bridge)."""

from __future__ import annotations

import shutil
from pathlib import Path

from broker_coordinator.access.broker import BrokerError, hash_password
from broker_coordinator.access.devices import (
    message_size_limit,
    open_registry,
    write_file,
)
from broker_coordinator.access.sites import (
    aggregator_toml,
    bridge_password,
    partial_allowance,
    render_bridge,
    render_site_acl,
    site_broker_conf,
    worker_password,
    worker_user,
)
from broker_coordinator.settings.config import CoordinatorConfig
from edgefl_protocol import signing

DEFAULT_DIR = "/etc/edgefl/sites"
CENTRAL_CA = "central-ca.pem"


def bridge_cafile(config: CoordinatorConfig, name: str) -> str:
    """The central broker's CA for the bridge, or "" for a plain bridge; a config error otherwise."""
    site, b = config.sites[name], config.broker
    if site.bridge_tls == "off" or (site.bridge_tls == "auto" and not b.tls):
        return ""
    cafile = site.bridge_cafile or b.tls_ca or b.tls_cert
    if not cafile:
        raise BrokerError(f"[sites.{name}] bridge_tls = \"on\" needs the central broker's CA: set "
                          f"[sites.{name}] bridge_cafile or [broker] tls_ca")
    if not Path(cafile).is_file():
        raise BrokerError(f"[sites.{name}] the central broker's CA {cafile}: no such file")
    return cafile


def write_site_files(config: CoordinatorConfig, name: str, out_dir: Path | None = None) -> list[Path]:
    if name not in config.sites:
        known = ", ".join(sorted(config.sites)) or "none"
        raise BrokerError(f"{config.path} has no [sites.{name}] (sites: {known}): add one with its devices' "
                          f"patterns, e.g. [sites.{name}] devices = \"{name}-*\"")
    site, fed, secret = config.sites[name], config.federation.name, config.broker.password
    out = Path(out_dir or site.out_dir or f"{DEFAULT_DIR}/{name}")
    registry = open_registry(config)
    hashes = {d: h for d, h in registry.broker_users(fed).items() if site.holds(d)}
    keys = {d: k for d, k in registry.signing_keys(fed).items() if site.holds(d)}
    passwd, acl, conf, agg, key_file = (out / n for n in ("passwd", "acl", "mosquitto.conf", "aggregator.toml",
                                                          "device_keys.toml"))
    cafile = bridge_cafile(config, name)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if cafile:
            shutil.copyfile(cafile, out / CENTRAL_CA)
        users = {**hashes, **{worker_user(name, w): hash_password(worker_password(secret, name))
                              for w in range(site.workers)}}
        write_file(passwd, "".join(f"{u}:{h}\n" for u, h in sorted(users.items())), 0o640)
        write_file(acl, render_site_acl(fed, name, site.workers, sorted(hashes)), 0o640)
        bridge = render_bridge(fed, name, config.broker.devices_host, config.broker.devices_port,
                               bridge_password(secret, name), str(out / CENTRAL_CA) if cafile else "")
        limit = message_size_limit(config) + partial_allowance()
        write_file(conf, site_broker_conf(site, passwd, acl, limit, bridge, max(1000, 2 * len(users))), 0o640)
        write_file(agg, aggregator_toml(fed, config.federation.model, site, secret, key_file), 0o600)
        signing.write_key_file(key_file, keys)
    except PermissionError as exc:
        raise BrokerError(f"cannot write {exc.filename}: run as root (sudo), or pass --out DIR") from None
    return [conf, passwd, acl, agg, key_file]
