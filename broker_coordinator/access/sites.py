"""Sites: a Mosquitto per site, bridged to the central one with Mosquitto's own bridge.

The coordinator's config names each site (`[sites.NAME]`) and which devices belong to it (glob
patterns over device ids). `broker-coordinator broker-config --site NAME` writes the site's
files into one directory, to be copied to the site's machine:

    mosquitto.conf    the site's listener, its devices' credentials and ACL, and a `connection`
                      block to the central broker: TLS when the central broker has TLS (its CA as
                      `bridge_cafile`), the bridge's own user, MQTT v5, a persistent session
    passwd, acl       the site's devices (from the registry) and its aggregator workers
    aggregator.toml   `broker-coordinator site-aggregator --config` reads it (site key, workers)
    device_keys.toml  the signing keys of the site's devices (the workers check update signatures)

What crosses the bridge (all QoS 1):
    in   edgefl/<fed>/model/#              the retained model, once per site (kept retained there)
    in   edgefl/<fed>/site/<site>/task     the coordinator's site task
    out  edgefl/<fed>/site/<site>/partial  the workers' partials
    out  edgefl/<fed>/site/<site>/status   the site's presence (devices online and eligible)
    out  edgefl/<fed>/site/<site>/bridge   Mosquitto's own bridge state notifications
Device tasks, updates, receipts and statuses stay at the site. On the central broker the bridge
logs in as `site-<site>`, whose ACL allows exactly those topics and no other site's.

The bridge's password and the key that signs the site's partials are derived from the
coordinator's broker password (as the operator tools' passwords are, see `broker`), so the
coordinator's config is the one secret to keep; the site's files hold only what the site needs.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from broker_coordinator.access.broker import render_acl, render_config
from broker_coordinator.settings.site_settings import SiteSettings
from edgefl_protocol import topics
from edgefl_protocol.settings import to_toml

SHARE_GROUP = "edgefl"
OBSERVED_ROW_BYTES = 512  # a partial's allowance per device row (rules that keep per-device state)
MAX_SITE_DEVICES = 10_000  # per partial


def partial_allowance() -> int:
    """Bytes a partial may carry beyond an update's cap: its per-device rows. Brokers carrying
    partials raise their max_packet_size by this much."""
    return OBSERVED_ROW_BYTES * MAX_SITE_DEVICES


def bridge_user(site: str) -> str:
    """The site bridge's broker user on the central broker."""
    return f"site-{site}"


def worker_user(site: str, worker: int) -> str:
    """A site aggregator worker's broker user on the site broker (one connection per user)."""
    return f"{site}-aggregator-{worker}"


def _derive(secret: str, purpose: str) -> bytes:
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).digest()


def bridge_password(coordinator_password: str, site: str) -> str:
    return _derive(coordinator_password, f"edgefl-site-bridge/{site}").hex()


def worker_password(coordinator_password: str, site: str) -> str:
    return _derive(coordinator_password, f"edgefl-site-aggregator/{site}").hex()


def site_key(coordinator_password: str, site: str) -> bytes:
    """The HMAC key that signs the site's partials."""
    return _derive(coordinator_password, f"edgefl-site-key/{site}")


def site_of(sites: dict[str, SiteSettings], device: str) -> str | None:
    for name, site in sorted(sites.items()):
        if site.holds(device):
            return name
    return None


# the central broker -----------------------------------------------------------------------------
def render_central_acl(federation: str, sites: list[str]) -> str:
    """ACL blocks of the sites' bridge users on the central broker: each reads the model and its
    own site task, and writes its own partials, status and bridge notifications."""
    base = f"{topics.ROOT}/{federation}"
    lines = []
    for site in sorted(sites):
        lines += ["", f"# the bridge of site {site}", f"user {bridge_user(site)}", f"topic read {base}/model/#",
                  f"topic read {base}/site/{site}/task", f"topic write {base}/site/{site}/partial",
                  f"topic write {base}/site/{site}/status", f"topic write {base}/site/{site}/bridge"]
    return "\n".join(lines) + "\n"


def central_users(coordinator_password: str, sites: list[str]) -> dict[str, str]:
    """user -> password of the sites' bridges, for the central broker's password file."""
    return {bridge_user(s): bridge_password(coordinator_password, s) for s in sites}


# the site broker --------------------------------------------------------------------------------
def render_bridge(federation: str, site: str, central_host: str, central_port: int, password: str,
                  cafile: str = "") -> str:
    """The `connection` block of a site broker (see mosquitto.conf(5), "Configuring Bridges")."""
    base = f"{topics.ROOT}/{federation}"
    lines = [
        "",
        "# bridge to the central broker: the model and this site's task in, its partials and status out",
        f"connection edgefl-{site}",
        f"address {central_host}:{central_port}",
        f"remote_username {bridge_user(site)}",
        f"remote_password {password}",
        f"remote_clientid {bridge_user(site)}",  # = the user name: the central broker ties the two
        "bridge_protocol_version mqttv50",
        "cleansession false",  # the central broker queues the site task while the link is down
        "try_private true",  # lets the central broker see a bridge (loop detection)
        "notifications true",
        f"notification_topic {base}/site/{site}/bridge",
        "restart_timeout 2 30",  # back off 2 s .. 30 s between reconnects
    ]
    if cafile:
        lines += [f"bridge_cafile {cafile}", "bridge_insecure false", "bridge_tls_version tlsv1.2"]
    lines += [f"topic {base}/model/# in 1", f"topic {base}/site/{site}/task in 1",
              f"topic {base}/site/{site}/partial out 1", f"topic {base}/site/{site}/status out 1"]
    return "\n".join(lines) + "\n"


def render_worker_acl(federation: str, site: str, workers: int) -> str:
    """The aggregator workers take the coordinator's place at the site: readwrite on the federation."""
    base = f"{topics.ROOT}/{federation}"
    return "".join(f"\nuser {worker_user(site, w)}\ntopic readwrite {base}/#\n" for w in range(workers))


def render_site_acl(federation: str, site: str, workers: int, devices: list[str]) -> str:
    """The devices' own pattern lines, as on the central broker, and the workers' blocks."""
    return render_acl(federation, worker_user(site, 0), devices) + render_worker_acl(federation, site, workers)


def site_broker_conf(site: SiteSettings, passwd: Path, acl: Path, max_packet_size: int, bridge: str,
                     max_queued_messages: int = 1000) -> str:
    return render_config(site.port, passwd, acl, max_packet_size, site.bind or "0.0.0.0", site.run_as or None,
                         max_queued_messages) + bridge


def aggregator_toml(federation: str, model: str, site: SiteSettings, coordinator_password: str,
                    device_keys: Path) -> str:
    return to_toml({
        "site": {"name": site.name, "federation": federation, "model": model, "workers": site.workers,
                 "key": site_key(coordinator_password, site.name).hex(), "device_keys": str(device_keys),
                 "share_group": SHARE_GROUP},
        "broker": {"host": site.host, "port": site.port,
                   "password": worker_password(coordinator_password, site.name)},
    })
