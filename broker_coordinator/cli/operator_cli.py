"""Operator subcommands of `broker-coordinator`: devices add|list|revoke|rotate, broker-config,
serve-enrollment, tasks, backup, restore, model list|export. Each reads the coordinator config (`--config`, default /etc/edgefl/coordinator.toml,
or $EDGEFL_COORDINATOR_CONFIG)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from broker_coordinator.settings.config import DEFAULT_PATH, ENV_PREFIX, load_config

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
OPERATOR_COMMANDS = ("devices", "broker-config", "serve-enrollment", "tasks", "backup", "restore", "model")


def build_operator_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="broker-coordinator")
    add_operator_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None,
                        help=f"coordinator TOML config (default {DEFAULT_PATH} or $EDGEFL_COORDINATOR_CONFIG)")
    parser.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)


def add_operator_commands(sub: argparse._SubParsersAction) -> None:
    devices = sub.add_parser("devices", help="register, list, revoke and rotate devices",
                             description="Manage the devices of the federation named in the config.")
    dsub = devices.add_subparsers(dest="devices_command", required=True)

    add = dsub.add_parser("add", help="register a device and print its one-time enrollment token")
    add.add_argument("name", help="device id (also its broker user name)")
    _common(add)
    add.set_defaults(run=run_add)

    listing = dsub.add_parser("list", help="devices with state, online status, last seen and rounds contributed")
    listing.add_argument("--no-probe", action="store_true", help="do not ask the broker who is online")
    _common(listing)
    listing.set_defaults(run=run_list)

    revoke = dsub.add_parser("revoke", help="remove a device's credentials, kick its session, reject its updates",
                             description="Remove the device's broker credentials (Mosquitto reloads and drops its "
                                         "session), clear its retained status, and reject its updates from now on. "
                                         "A revoked name stays revoked: enroll the device again under a new name.")
    revoke.add_argument("name")
    _common(revoke)
    revoke.set_defaults(run=run_revoke)

    rotate = dsub.add_parser("rotate", help="new credentials and signing key; prints a new enrollment token",
                             description="Issue the device new broker credentials, a new signing key and a one-time "
                                         "enrollment token (printed); its old credentials stop working at once. On the "
                                         "device: edge-agent enroll TOKEN, then restart the agent.")
    rotate.add_argument("name")
    _common(rotate)
    rotate.set_defaults(run=run_rotate)

    conf = sub.add_parser("broker-config", help="write the Mosquitto conf.d fragment, password and ACL files",
                          description="Write the Mosquitto configuration fragment (listener, TLS when certificate "
                                      "paths are configured, allow_anonymous false, password and ACL files, "
                                      "max_packet_size sized to the model, one connection per user), the "
                                      "password and ACL files, with the broker users of the coordinator, of "
                                      "these tools and of serve-enrollment.")
    conf.add_argument("--out", type=Path, default=None,
                      help="fragment path (default: [broker] conf_file); with --site, the directory")
    conf.add_argument("--site", default=None, metavar="NAME",
                      help="write site NAME's files instead ([sites.NAME]: its broker's config with the bridge "
                           "to this broker, its devices' credentials and ACL, its aggregator's config)")
    conf.add_argument("--reload", action="store_true", help="reload mosquitto afterwards")
    _common(conf)
    conf.set_defaults(run=run_broker_config)

    serve = sub.add_parser("serve-enrollment", help="redeem enrollment tokens until stopped (SIGTERM)",
                           description="Connect to the broker (as the coordinator's enrollment user) and "
                                       "answer devices running 'edge-agent enroll'. Not needed while "
                                       "'broker-coordinator run' is up, which hosts the same desk.")
    _common(serve)
    serve.set_defaults(run=run_serve_enrollment)

    tasks = sub.add_parser("tasks", help="list the federation's tasks: the current one and the archived ones",
                           description="A task is one training run: a model trained from a fresh start. Changing "
                                       "[federation] model, task, loss or test_data, or [algorithm] algorithm, "
                                       "starts a new task at the next 'run' for the same devices; the old one is "
                                       "archived with its rounds and checkpoints (docs/OPERATOR.md, 'Changing the "
                                       "model').")
    _common(tasks)
    tasks.set_defaults(run=run_tasks)

    save = sub.add_parser("backup", help="copy the state, the broker's files and the config to DIR, while it runs",
                          description="Copy what a new machine needs to go on with the federation and its devices "
                                      "into DIR (new or empty): the device registry and every task's rounds (SQLite's "
                                      "online backup), the checkpoints, the broker's password, ACL and TLS files, "
                                      "and the config with the coordinator's secret; then DIR/manifest.json with "
                                      "each file's size and sha256. Safe while the coordinator runs.")
    save.add_argument("dir", type=Path, metavar="DIR", help="where the backup goes (a new or empty directory)")
    _common(save)
    save.set_defaults(run=run_backup)

    back = sub.add_parser("restore", help="put a backup back in place (with the coordinator stopped)",
                          description="Check every file of the backup in DIR against its manifest, then write the "
                                      "state directory, the broker's files and, when --config names no file yet, "
                                      "the backed-up config. Refused while a coordinator uses the state directory, "
                                      "and onto a state directory that is not empty unless --force.")
    back.add_argument("dir", type=Path, metavar="DIR", help="a directory 'broker-coordinator backup' wrote")
    back.add_argument("--force", action="store_true", help="empty a state directory that is not empty first")
    back.add_argument("--reload", action="store_true", help="reload mosquitto afterwards")
    _common(back)
    back.set_defaults(run=run_restore)

    model = sub.add_parser("model", help="list the model versions the state directory holds, and export one",
                           description="The current task's model versions (the live checkpoint and the kept ones) "
                                       "and their export as files an application loads without EdgeFL "
                                       "(docs/OPERATOR.md, 'Exporting a model'). Safe while the coordinator runs.")
    msub = model.add_subparsers(dest="model_command", required=True)
    versions = msub.add_parser("list", help="versions with round, score, and whether the served average is kept")
    _common(versions)
    versions.set_defaults(run=run_model_list)
    out = msub.add_parser("export", help="write one version as a file, with metadata.json beside it",
                          description="Write a model version into OUT (created; a directory that is not empty is "
                                      "refused without --force): model.pt (a torch state_dict), model.ts "
                                      "(TorchScript) or model.onnx, and metadata.json (version, round, task, "
                                      "score, architecture, input shape, label names, fingerprint, sha256). The "
                                      "served average is exported where it is kept ([evaluation] serve_average).")
    out.add_argument("out", type=Path, metavar="OUT", help="the directory to write")
    out.add_argument("--version", type=int, default=None, metavar="N",
                     help="the model version ('model list'; default: the current one)")
    out.add_argument("--format", default="state_dict", choices=["state_dict", "torchscript", "onnx"],
                     help="state_dict: model.pt (torch.save); torchscript: model.ts; onnx: model.onnx "
                          "(needs pip install edgefl[onnx])")
    out.add_argument("--last", action="store_true",
                     help="the last global model instead of the served average")
    out.add_argument("--force", action="store_true", help="write into OUT even if it is not empty")
    _common(out)
    out.set_defaults(run=run_model_export)
    promote = msub.add_parser("promote", help="publish a kept version for the devices to serve, whatever its score",
                              description="Ask the running coordinator to publish model version N (its served "
                                          "average where kept) as the release its devices serve ([serving]), "
                                          "even when a later version scored better or worse. Each device still "
                                          "takes it through its own gate (its held-out data).")
    promote.add_argument("version", type=int, metavar="N", help="the model version ('model list')")
    _common(promote)
    promote.set_defaults(run=run_model_promote)


def config_path(given: str | Path | None) -> Path:
    """--config, else $EDGEFL_COORDINATOR_CONFIG, else /etc/edgefl/coordinator.toml: one rule for every
    subcommand that reads the coordinator's config."""
    return Path(given) if given else Path(os.environ.get(f"{ENV_PREFIX}_CONFIG", DEFAULT_PATH))


def _config(args: argparse.Namespace):  # noqa: ANN202 - a CoordinatorConfig
    """The coordinator config ([rounds] is not needed here, and would import torch)."""
    return load_config(config_path(args.config), with_rounds=False)


def _print_token(name: str, text: str, token, note: str) -> None:  # noqa: ANN001
    expires = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(token.expires))
    print(f"device {name}: one-time enrollment token, valid until {expires} ({note}):")
    print(text)
    print("on the device: sudo edge-agent enroll <the token above>")


def run_add(args: argparse.Namespace) -> int:
    from broker_coordinator.access.devices import add_device
    text, token, note = add_device(_config(args), args.name)
    _print_token(args.name, text, token, note)
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    from broker_coordinator.access.devices import rotate_device
    text, token, note = rotate_device(_config(args), args.name)
    _print_token(args.name, text, token, f"old credentials dropped; {note}")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from broker_coordinator.access.devices import revoke_device
    note = revoke_device(_config(args), args.name)
    print(f"device {args.name} revoked: credentials removed, {note}; its updates are rejected from now on")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from broker_coordinator.access.devices import format_rows, list_devices
    config = _config(args)
    rows, note = list_devices(config, probe=not args.no_probe)
    if not rows:
        print(f"no devices in federation {config.federation.name}: add one with 'broker-coordinator devices add NAME'")
        return 0
    print(format_rows(rows))
    from broker_coordinator.engine.presence import agent_release
    releases = Counter(agent_release(r.profile) for r in rows if r.online == "online")
    if releases:  # the fleet's agent releases ("unknown": 0.1.0, which does not say)
        print("agent releases online: " + ", ".join(f"{v} x{n}" for v, n in sorted(releases.items())))
    waiting = not_eligible(rows, config.federation.min_protocol)
    if waiting:
        print("not eligible to train now, by their owners' [conditions] or their agent's protocol "
              "(edge-agent status on the device says more):")
        print("\n".join(f"  {name}: {why}" for name, why in waiting))
    if note:
        print(f"note: {note}")
    return 0


def not_eligible(rows, min_protocol: int = 1) -> list[tuple[str, str]]:  # noqa: ANN001 - DeviceRows
    """(device, why) for the online devices whose status says they may not train now, or whose agent
    speaks no protocol version the coordinator serves."""
    from broker_coordinator.engine.presence import ineligible_because
    from edgefl_protocol.protocol import serves
    return [(r.device.name, why) for r in rows
            if r.online == "online" and (why := ineligible_because(r.profile, serves(min_protocol)))]


def run_broker_config(args: argparse.Namespace) -> int:
    from broker_coordinator.access.devices import reload_broker, write_broker_config
    config = _config(args)
    if args.site:
        from broker_coordinator.access.site_files import bridge_cafile, write_site_files
        written = write_site_files(config, args.site, args.out)
        tls = "TLS" if bridge_cafile(config, args.site) else "no TLS"
        print(f"wrote site {args.site}: {', '.join(str(p) for p in written)} (bridge to "
              f"{config.broker.devices_host}:{config.broker.devices_port}, {tls}); on the site's machine: "
              f"mosquitto -c {written[0]}, and broker-coordinator site-aggregator --config {written[3]}")
        return 0
    conf, limit = write_broker_config(config, args.out)
    b = config.broker
    tls = "TLS on" if b.tls else "no TLS (set [broker] tls_cert and tls_key to turn it on)"
    local = f", local listener {b.port} for the coordinator" if b.devices_port != b.port else ""
    print(f"wrote {conf} (listener {b.devices_port}{local}, {tls}, max_packet_size {limit}), "
          f"{b.passwd_file} and {b.acl_file}")
    if args.reload:
        print(reload_broker(b))
    return 0


def run_tasks(args: argparse.Namespace) -> int:
    from broker_coordinator.cli import state_cli
    return state_cli.tasks(_config(args))


def run_backup(args: argparse.Namespace) -> int:
    from broker_coordinator.cli import state_cli
    return state_cli.back_up(_config(args), args.dir)


def run_restore(args: argparse.Namespace) -> int:
    from broker_coordinator.cli import state_cli
    return state_cli.restore_from(args.dir, config_path(args.config), args.force, args.reload)


def run_model_list(args: argparse.Namespace) -> int:
    from broker_coordinator.cli import model_cli
    return model_cli.list_models(_config(args))


def run_model_promote(args: argparse.Namespace) -> int:
    from broker_coordinator.cli import model_cli
    return model_cli.promote(_config(args), args.version)


def run_model_export(args: argparse.Namespace) -> int:
    from broker_coordinator.cli import model_cli
    return model_cli.export(_config(args), args.version, args.format, args.out, args.last, args.force)


def run_serve_enrollment(args: argparse.Namespace) -> int:
    from broker_coordinator.access.broker import BrokerError, desk_user
    from broker_coordinator.access.devices import desk_client, open_registry
    from broker_coordinator.access.enrollment import EnrollmentDesk
    from edgefl_protocol.transport import BrokerUnavailable, connect
    config = _config(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = desk_client(config)
    try:
        connect(client, config.broker.host, config.broker.port, timeout=10)
    except BrokerUnavailable as exc:
        hint = (f" (is the {desk_user(config.broker.username)} user in the password file? "
                "'sudo broker-coordinator broker-config --reload' writes it)" if "refused" in str(exc) else "")
        raise BrokerError(f"{exc}{hint}") from None
    desk = EnrollmentDesk(config, open_registry(config), echo=lambda line: print(line, flush=True))
    desk.attach(client)
    print(f"enrollment desk for federation {config.federation.name} on {config.broker.host}:{config.broker.port}",
          flush=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        desk.stop()
        client.disconnect()
        client.loop_stop()
    return 0
