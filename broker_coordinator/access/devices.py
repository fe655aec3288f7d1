"""What `broker-coordinator devices ...` and `broker-config` do: device credentials and the broker's files.

Credentials live in Mosquitto's `password_file` (PBKDF2-SHA512 `$7$` hashes,
the format `mosquitto_passwd` writes) and are regenerated from the registry on
every change; the broker then gets SIGHUP (through its pid file, or a
configurable command such as `systemctl reload mosquitto.service`). Mosquitto
2.0 re-checks every connected client against the reloaded password file and
disconnects the ones that no longer match, which is how a revoked device's
session is kicked (see the README's operator guide and tests/test_security.py).

The tools here talk to the broker as the admin user (`broker.admin_user`), never
as the coordinator: the broker allows one connection per user, and connecting
as the coordinator would kick the running coordinator off.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import signal
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker_coordinator.access.broker import (
    BrokerError,
    admin_password,
    admin_user,
    desk_password,
    desk_user,
    hash_password,
    render_acl,
    render_fragment,
    reserved_users,
    tool_users,
)
from broker_coordinator.access.registry import (
    REVOKED,
    Activity,
    Device,
    Registry,
    directory_owner,
)
from broker_coordinator.access.sites import (
    central_users,
    partial_allowance,
    render_central_acl,
)
from broker_coordinator.settings.config import CoordinatorBroker, CoordinatorConfig
from edgefl_protocol import enrollment as tokens
from edgefl_protocol import messages, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.persist import atomic_write
from edgefl_protocol.transport import connect, make_client

SIGNING_KEY_BYTES = 32


def open_registry(config: CoordinatorConfig) -> Registry:
    return Registry(config.registry_path)


# the broker's files ---------------------------------------------------------------------
def write_file(path: Path, text: str, mode: int) -> None:
    """Write atomically and fsynced (persist.atomic_write) with `mode`, owned like its directory when
    run as root. The temp file's name is unique: the CLI and the service's enrollment desk (which
    rewrites the password file when a token expires) may write the same file at the same moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text, mode, owner=directory_owner(path))


def render_password_file(config: CoordinatorConfig, registry: Registry) -> str:
    users = registry.broker_users(config.federation.name)
    if not config.broker.password:
        raise BrokerError(f"{config.path} [broker] password is empty: set the coordinator's broker password")
    users[config.broker.username] = hash_password(config.broker.password)
    for user, password in tool_users(config.broker.username, config.broker.password).items():
        users[user] = hash_password(password)
    for user, password in central_users(config.broker.password, list(config.sites)).items():
        users[user] = hash_password(password)  # the sites' bridges
    return "".join(f"{user}:{digest}\n" for user, digest in sorted(users.items()))


def sync_broker_files(config: CoordinatorConfig, registry: Registry) -> None:
    """Regenerate the password and ACL files from the registry (the broker still needs a reload)."""
    b = config.broker
    try:
        write_file(Path(b.passwd_file), render_password_file(config, registry), 0o640)
        devices = registry.broker_users(config.federation.name)
        write_file(Path(b.acl_file), render_acl(config.federation.name, b.username, devices)
                   + render_central_acl(config.federation.name, list(config.sites)), 0o640)
    except PermissionError as exc:
        raise BrokerError(f"cannot write {exc.filename}: run as root (sudo) or as the coordinator's service user") from None


def reload_broker(b: CoordinatorBroker) -> str:
    """SIGHUP to Mosquitto: through its pid file when we may signal it, else through reload_command."""
    problems = []
    if b.pid_file:
        try:
            pid = int(Path(b.pid_file).read_text().strip())
            os.kill(pid, signal.SIGHUP)
            return f"sent SIGHUP to mosquitto (pid {pid} from {b.pid_file})"
        except FileNotFoundError:
            problems.append(f"no pid file {b.pid_file}")
        except (ValueError, ProcessLookupError):
            problems.append(f"pid file {b.pid_file} is stale")
        except PermissionError:
            problems.append(f"not allowed to signal the pid in {b.pid_file}")
    if b.reload_command:
        try:
            done = subprocess.run(shlex.split(b.reload_command), capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"'{b.reload_command}' failed: {exc}")
        else:
            if done.returncode == 0:
                return f"ran '{b.reload_command}'"
            problems.append(f"'{b.reload_command}' exited {done.returncode}: "
                            f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or ''}")
    raise BrokerError("mosquitto was not reloaded (" + "; ".join(problems or ["no pid_file or reload_command set"])
                      + "): run 'sudo systemctl reload mosquitto' so the change takes effect")


def apply(config: CoordinatorConfig, registry: Registry) -> str:
    sync_broker_files(config, registry)
    return reload_broker(config.broker)


def message_size_limit(config: CoordinatorConfig) -> int:
    """Bytes, for the broker's max_packet_size: `[broker] message_size_limit` if set, else the
    largest message the coordinator accepts or sends (see limits.py), for the config's model and
    [rounds] (read from the file when `config` was loaded without them)."""
    if config.broker.message_size_limit:
        return config.broker.message_size_limit
    from broker_coordinator.settings.config import load_config
    from broker_coordinator.settings.limits import (
        federation_packet_limit,  # imports torch
    )
    rounds = config.rounds if config.rounds is not None else load_config(config.path).rounds
    return federation_packet_limit(config.federation.model, rounds)


def ca_fingerprint(path: str) -> str:
    """SHA-256 of a PEM certificate's DER bytes, as hex (what `openssl x509 -fingerprint -sha256` shows)."""
    try:
        pem = Path(path).read_text()
        der = ssl.PEM_cert_to_DER_cert(pem)
    except (OSError, ValueError) as exc:
        raise BrokerError(f"cannot read the CA certificate {path}: {exc}") from None
    return hashlib.sha256(der).hexdigest()


def write_broker_config(config: CoordinatorConfig, conf_file: Path | None = None) -> tuple[Path, int]:
    """Write the conf.d fragment, and the password and ACL files."""
    b = config.broker
    for name in ("tls_cert", "tls_key", "tls_ca"):
        value = getattr(b, name)
        if value and not Path(value).is_file():
            raise BrokerError(f"[broker] {name} = {value}: no such file")
    limit = message_size_limit(config) + (partial_allowance() if config.sites else 0)
    conf = conf_file or Path(b.conf_file)
    registry = open_registry(config)
    try:
        write_file(conf, render_fragment(b.devices_port, Path(b.passwd_file), Path(b.acl_file), limit, b.bind,
                                         b.tls_cert, b.tls_key, b.tls_ca, local_port=b.port), 0o644)
    except PermissionError:
        raise BrokerError(f"cannot write {conf}: run as root (sudo), or pass --out PATH") from None
    sync_broker_files(config, registry)
    return conf, limit


# devices ---------------------------------------------------------------------------------
def _new_token(config: CoordinatorConfig, name: str) -> tuple[tokens.EnrollmentToken, str]:
    b = config.broker
    token = tokens.EnrollmentToken(
        device=name, federation=config.federation.name, host=b.devices_host, port=b.devices_port,
        password=secrets.token_urlsafe(18), signing_key=secrets.token_hex(SIGNING_KEY_BYTES),
        token_id=secrets.token_hex(8), expires=time.time() + config.enrollment.token_hours * 3600,
        tls=b.tls, ca_sha256=ca_fingerprint(b.tls_ca or b.tls_cert) if b.tls else "")
    return token, tokens.encode_token(token)


def add_device(config: CoordinatorConfig, name: str) -> tuple[str, tokens.EnrollmentToken, str]:
    """Register `name` as pending; return (token text, token, reload note)."""
    topics.check_name("device", name)
    if name in reserved_users(config.broker.username):
        raise BrokerError(f"{name!r} is the broker user of the coordinator or its tools: choose another device name")
    registry = open_registry(config)
    token, text = _new_token(config, name)
    registry.add(name, config.federation.name, hash_password(token.password), token.signing_key,
                 token.token_id, token.expires)
    return text, token, apply(config, registry)


def rotate_device(config: CoordinatorConfig, name: str) -> tuple[str, tokens.EnrollmentToken, str]:
    """New one-time password, signing key and token; the old credentials stop working at once."""
    registry = open_registry(config)
    token, text = _new_token(config, name)
    registry.reissue(name, hash_password(token.password), token.signing_key, token.token_id, token.expires)
    note = apply(config, registry)
    return text, token, note + clear_status(config, name)


def revoke_device(config: CoordinatorConfig, name: str) -> str:
    registry = open_registry(config)
    registry.revoke(name)
    try:
        note = apply(config, registry)
    except BrokerError as exc:
        raise BrokerError(f"{name} is revoked in the registry (its updates are rejected), but {exc}") from None
    return note + clear_status(config, name)


def clear_status(config: CoordinatorConfig, name: str) -> str:
    """Remove the device's retained `online` status. Mosquitto 2.0.11 drops the session of a device
    whose password is gone without publishing its will, so nobody else would say it is offline."""
    client = admin_client(config)
    try:
        connect(client, config.broker.host, config.broker.port, timeout=5)
    except Exception as exc:  # noqa: BLE001 - the credentials change is done; this is housekeeping
        return f"; its retained status was not cleared ({exc})"
    try:
        info = client.publish(topics.status(config.federation.name, name), b"", qos=1, retain=True)
        info.wait_for_publish(timeout=5)
    finally:
        client.disconnect()
        client.loop_stop()
    return "; its retained status cleared"


@dataclass
class DeviceRow:
    device: Device
    online: str  # "online" | "offline" | "revoked" | "-" (unknown)
    activity: Activity
    # its last status profile: live from the broker, else as the coordinator last stored it; an
    # agent whose owner's conditions keep it from training says `eligible` false and `why` there
    profile: dict[str, Any] = field(default_factory=dict)


def list_devices(config: CoordinatorConfig, probe: bool = True, wait: float = 1.0) -> tuple[list[DeviceRow], str]:
    """Registry rows; online and the status profile from the devices' retained status topics (asked
    live), last seen and rounds contributed from the round store's tables."""
    registry = open_registry(config)
    devices = registry.devices(config.federation.name)
    live: dict[str, messages.Status] = {}
    note = ""
    if probe and devices:
        try:
            live = read_statuses(config, wait)
        except Exception as exc:  # noqa: BLE001 - the registry view is still useful without the broker
            hint = (f" (the password file has no {admin_user(config.broker.username)} user yet: run "
                    "'sudo broker-coordinator broker-config --reload')" if "refused" in str(exc) else "")
            note = f"broker not reachable ({exc}){hint}; online state from the last the coordinator saw"
    activity = registry.activity()
    stored = stored_profiles(registry)
    rows = []
    for d in devices:
        seen = activity.get(d.name, Activity())
        if d.state == REVOKED:
            online = "revoked"
        elif probe and not note:
            online = "online" if d.name in live and live[d.name].state == "online" else "offline"
        elif d.name in activity:
            online = "online" if seen.online else "offline"
        else:
            online = "-"
        profile = dict(live[d.name].profile) if d.name in live else stored.get(d.name, {})
        rows.append(DeviceRow(d, online, seen, profile))
    return rows, note


def stored_profiles(registry: Registry) -> dict[str, dict[str, Any]]:
    """Each device's last status profile as the coordinator stored it (the round store's `presence`
    table, in the registry's database); empty until the coordinator has run."""
    with registry.connect() as db:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'presence'").fetchone():
            return {}
        rows = db.execute("SELECT device, profile FROM presence WHERE profile IS NOT NULL").fetchall()
    found = {}
    for device, text in rows:
        try:
            profile = json.loads(text)
        except ValueError:
            continue
        if isinstance(profile, dict):
            found[device] = profile
    return found


def coordinator_client(config: CoordinatorConfig, suffix: str):  # noqa: ANN201 - a paho client
    """A client of the coordinator's own user (tests; what `broker-coordinator run` connects as). The broker
    uses the user name as client id, so this takes over any other connection of that user."""
    b = config.broker
    return make_client(f"{b.username}-{config.federation.name}-{suffix}", b.username, b.password)


def desk_client(config: CoordinatorConfig):  # noqa: ANN201 - a paho client
    """A client of `serve-enrollment`'s own user: it may run beside the coordinator."""
    user = desk_user(config.broker.username)
    return make_client(user, user, desk_password(config.broker.password))


def admin_client(config: CoordinatorConfig):  # noqa: ANN201 - a paho client
    """A client of the operator tools' own user: connecting does not disturb the coordinator."""
    b = config.broker
    user = admin_user(b.username)
    return make_client(user, user, admin_password(b.password))


def probe_statuses(config: CoordinatorConfig, wait: float) -> dict[str, bool]:
    """Online or not, per device, from the retained statuses (`read_statuses`)."""
    return {device: status.state == "online" for device, status in read_statuses(config, wait).items()}


def read_statuses(config: CoordinatorConfig, wait: float) -> dict[str, messages.Status]:
    """Connect as the admin user, read the retained status of every device, disconnect."""
    fed = config.federation.name
    seen: dict[str, messages.Status] = {}
    last = [time.monotonic()]
    client = admin_client(config)

    def on_message(c, u, msg) -> None:  # noqa: ANN001
        last[0] = time.monotonic()
        parsed = topics.parse_device_topic(msg.topic)
        if parsed is None or not msg.payload:
            return
        try:
            seen[parsed[1]] = messages.decode_status(msg.payload)
        except Rejected:
            pass

    client.on_message = on_message
    connect(client, config.broker.host, config.broker.port, timeout=5)
    try:
        done = threading.Event()
        client.on_subscribe = lambda *a: done.set()
        client.subscribe(topics.all_statuses(fed), qos=1)
        done.wait(5)
        last[0] = time.monotonic()  # retained messages follow the SUBACK: stop after 0.3 s of quiet
        give_up = time.monotonic() + wait
        while time.monotonic() < give_up and time.monotonic() - last[0] < 0.3:
            time.sleep(0.05)
    finally:
        client.disconnect()
        client.loop_stop()
    return seen


def format_rows(rows: list[DeviceRow]) -> str:
    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

    table = [("DEVICE", "STATE", "ONLINE", "LAST SEEN", "ROUNDS", "LAST ROUND")]
    for r in rows:
        d = r.device
        a = r.activity
        table.append((d.name, d.state, r.online, when(a.last_seen), str(a.rounds) if a.last_seen or a.rounds else "-",
                      str(a.last_round) if a.last_round is not None else "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
