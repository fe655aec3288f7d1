"""Device-side operator subcommands of `edge-agent`: enroll, install-service, status."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .enroll import DEFAULT_CONFIG, DEFAULT_STATE_DIR


def add_operator_commands(sub: argparse._SubParsersAction) -> None:
    enroll = sub.add_parser("enroll", help="redeem a one-time enrollment token and write the agent config",
                            description="Redeem the token printed by 'broker-coordinator devices add NAME', write "
                                        "the agent config (mode 0600) and check that the new credentials connect.")
    enroll.add_argument("token")
    enroll.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="where to write the agent config (default: %(default)s)")
    enroll.add_argument("--data", default=None, help="the device's data file (.npz with x and y); "
                                                      "default STATE_DIR/data.npz")
    enroll.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                        help="where the agent keeps its state (default: %(default)s)")
    enroll.add_argument("--ca-file", type=Path, default=None,
                        help="with TLS: the CA certificate (default: the broker's own, pinned by the token)")
    enroll.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for the coordinator (default: %(default)s)")
    enroll.set_defaults(handler=run_enroll)

    install = sub.add_parser("install-service", help="install and enable the systemd unit",
                             description="Install systemd/edge-agent.service for this installation and enable it "
                                         "(with --serve, the prediction server's unit too). Without root, prints "
                                         "the commands to run instead.")
    install.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the enrolled agent config")
    install.add_argument("--memory-max", default="70%", help="systemd MemoryMax for the agent (e.g. 512M, 70%%)")
    install.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    install.add_argument("--serve", action="store_true",
                         help="also install edge-agent-serve.service (predictions on /run/edgefl-serve/serve.sock) "
                              "and make the serving store readable by [serving] group: creates the group, the "
                              "system user edge-agent and the store's directory ([serving] dir, outside the "
                              "state directory)")
    install.set_defaults(handler=run_install)

    status = sub.add_parser("status", help="enrolled or not, broker reachable, last round, may it train now, "
                                           "service state",
                            description="Whether this device is enrolled, whether its broker accepts its "
                                        "credentials, the last round it trained, its owner's [conditions] and "
                                        "whether it may train now (and why not), and the systemd service's state.")
    status.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the agent config (default: %(default)s)")
    status.set_defaults(handler=run_status)


def _fail(message: str, code: int = 2) -> int:
    print(f"edge-agent: error: {message}", file=sys.stderr)
    return code


def run_enroll(args: argparse.Namespace) -> int:
    from .enroll import EnrollError, enroll
    try:
        done = enroll(args.token, args.config, args.data, args.state_dir, args.ca_file, args.timeout)
    except EnrollError as exc:
        return _fail(str(exc))
    print(f"enrolled {done.device} in federation {done.federation}: connected to {done.host}:{done.port}"
          f"{' over TLS' if done.tls else ''} with the new credentials; config written to {done.config}")
    return 0


def run_install(args: argparse.Namespace) -> int:
    from .service import ServiceError, install
    try:
        code, text = install(args.config, args.memory_max, args.dry_run, serve=args.serve)
    except ServiceError as exc:
        return _fail(str(exc))
    print(text, file=sys.stdout if code == 0 else sys.stderr)
    return code


def run_status(args: argparse.Namespace) -> int:
    from .service import status
    code, lines = status(args.config)
    print("\n".join(lines))
    return code
