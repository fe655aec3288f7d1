"""`broker-coordinator`: the server-side command. The simulate subcommand's options and handler
live in `simulate_cli`, imported only when the command is `simulate`: the production
subcommands import no simulation code."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from broker_coordinator.cli.arguments import bounded


def build_parser(simulate: bool = True) -> argparse.ArgumentParser:
    """The whole command line; `simulate=False` leaves the simulate subcommand's options out (it
    is still listed), so that parsing any other subcommand imports no simulation code."""
    parser = argparse.ArgumentParser(
        prog="broker-coordinator",
        description="EdgeFL coordinator: runs federated rounds over a Mosquitto broker.")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser(
        "simulate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="run a whole federation on this machine (private broker, one process per agent)",
        description="Start a private Mosquitto on a free loopback port with generated credentials and ACL, "
                    "spawn one agent process per device with its own data shard, and run the rounds. "
                    "Prints one line per round and writes history.json and a plot of the task's metric "
                    "(accuracy.png, or mse.png / mae.png) into --out. Your own model and data: --model "
                    "package.module:factory with --devices-dir (docs/OWN_MODEL.md).")
    if simulate:
        from broker_coordinator.cli.simulate_cli import add_simulate_arguments
        add_simulate_arguments(sim)
    run = sub.add_parser("run", help="serve rounds for a real fleet, as configured (the systemd service runs this)",
                         description="Connect to the broker named in the config and run rounds until the "
                                     "configured count or SIGTERM. Resumes from the last checkpoint in state_dir.")
    default_config = "default /etc/edgefl/coordinator.toml or $EDGEFL_COORDINATOR_CONFIG"
    run.add_argument("--config", default=None,
                     help=f"coordinator TOML config (every section and key: docs/CONFIGURATION.md; {default_config})")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    stat = sub.add_parser("status", help="show the federation at a glance: last round, devices, accuracy")
    stat.add_argument("--config", default=None, help=f"coordinator TOML config ({default_config})")
    stat.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    wake = sub.add_parser("resume", help="wake a federation that rests because its model stopped improving",
                          description="A federation rests when the served model has not improved for [pacing] "
                                      "patience evaluations ('status' says so). This asks the running coordinator "
                                      "to open rounds again; it also resumes by itself when its devices report "
                                      "[pacing] new_data more samples.")
    wake.add_argument("--config", default=None, help=f"coordinator TOML config ({default_config})")
    wake.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    back = sub.add_parser("rollback", help="make an earlier round's kept checkpoint the live model",
                          description="Stop the coordinator first. The kept checkpoint of ROUND (the last "
                                      "[storage] keep_checkpoints rounds are kept) becomes the live one under a new "
                                      "model version; the next 'run' resumes at ROUND + 1. Later rounds stay in the "
                                      "history, marked by a rollback row.")
    back.add_argument("--config", default=None, help=f"coordinator TOML config ({default_config})")
    back.add_argument("--to", type=bounded(int, 1), required=True, metavar="ROUND", help="the round to go back to")
    back.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    site = sub.add_parser("site-aggregator", help="aggregate a site's updates beside its broker (docs/ARCHITECTURE.md, 'Sites')",
                          description="Task the site's devices for each site task, validate and fold their "
                                      "updates, and send one signed partial per round up the bridge. The config "
                                      "comes from 'broker-config --site NAME'.")
    site.add_argument("--config", required=True, help="the site's aggregator.toml")
    site.add_argument("--worker", type=bounded(int, 0, 63), default=0,
                      help="this worker's index (0 also tasks the devices and reports presence)")
    site.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    from broker_coordinator.cli.operator_cli import add_operator_commands
    add_operator_commands(sub)
    parser.simulate_parser = sim  # type: ignore[attr-defined] (given_flags reads which flags were written)
    return parser


def main(argv: list[str] | None = None) -> int:
    from broker_coordinator.cli.operator_cli import (
        OPERATOR_COMMANDS,
        build_operator_parser,
    )
    argv = sys.argv[1:] if argv is None else argv
    # operator commands need no torch: parse them without the simulate parser's imports; the other
    # production commands parse without simulate's options (and so without simulation code)
    parser = build_operator_parser() if argv[:1] and argv[0] in OPERATOR_COMMANDS else \
        build_parser(simulate=argv[:1] == ["simulate"])
    args = parser.parse_args(argv)
    # journald stamps time and unit itself; elsewhere a timestamp helps
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format=fmt)
    from broker_coordinator.access.broker import BrokerError
    from broker_coordinator.access.registry import RegistryError
    from broker_coordinator.storage.statelock import StateLocked
    from broker_coordinator.storage.store import StoreError
    from edgefl_protocol.settings import ConfigError
    from edgefl_protocol.transport import BrokerUnavailable
    from edgefl_models.datasets import DatasetError

    errors: tuple[type[BaseException], ...] = (BrokerError, BrokerUnavailable, ConfigError, DatasetError,
                                               RegistryError, StateLocked, StoreError, ValueError, TimeoutError,
                                               OSError)
    if not hasattr(args, "run"):  # the operator commands (args.run) do without torch
        from broker_coordinator.engine.rounds import RoundFailed
        errors += (RoundFailed,)
    try:
        if args.command == "simulate":
            from broker_coordinator.cli import simulate_cli
            return simulate_cli.run_simulate(args, simulate_cli.given_flags(parser, argv))
        if hasattr(args, "run"):
            return args.run(args)
        if args.command == "site-aggregator":
            from broker_coordinator.cli import site_service
            return site_service.run(args.config, args.worker, lambda line: print(line, flush=True))
        from broker_coordinator.cli import service
        from broker_coordinator.cli.operator_cli import config_path
        from broker_coordinator.settings.config import load_config
        config = load_config(config_path(args.config))
        echo = lambda line: print(line, flush=True)  # noqa: E731
        if args.command == "rollback":
            return service.rollback(config, args.to, echo)
        if args.command == "resume":
            return service.resume(config, echo)
        return service.run(config, echo) if args.command == "run" else service.status(config, echo)
    except errors as exc:
        print(f"broker-coordinator: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("broker-coordinator: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
