"""`edge-agent`: the device-side command."""

from __future__ import annotations

import argparse
import logging
import sys

from edgefl_protocol.settings import ConfigError
from edgefl_protocol.transport import BrokerUnavailable
from edgefl_models.datasets import DatasetError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="EdgeFL device agent: trains the federation's model on this device's own data "
                    "and exchanges updates with the coordinator over MQTT.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="connect to the broker and serve rounds until stopped (SIGTERM)",
                         description="Connect to the broker named in the config file and train on every task "
                                     "the coordinator sends, until SIGTERM or Ctrl-C.")
    run.add_argument("--config", required=True, help="agent TOML config (every section and key: docs/CONFIGURATION.md)")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    from .model_cli import add_model_commands
    from .operator_cli import add_operator_commands
    from .serve import add_serve_command
    add_operator_commands(sub)
    add_model_commands(sub)
    add_serve_command(sub)
    args = parser.parse_args(argv)
    if args.command != "run":
        return args.handler(args)

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .agent import Agent  # torch import is slow; keep --help fast
    from .config import load_config

    try:
        return Agent(load_config(args.config)).run()
    except (ConfigError, DatasetError, BrokerUnavailable, ValueError) as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
