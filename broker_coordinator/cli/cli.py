"""`broker-coordinator`: the server-side command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from edgefl_protocol import topics
from models import partition


def _bounded(kind: type, low: float, high: float | None = None):  # noqa: ANN202
    def parse(text: str):  # noqa: ANN202
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if value < low or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {span}")
        return value
    return parse


def _partition(text: str) -> str:
    try:
        partition.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _hparam(text: str) -> tuple[str, float | str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, float(value)
    except ValueError:
        return key, value


def _codec(text: str) -> str:
    from edgefl_protocol import codec
    try:
        return codec.parse(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _uplink_codec(text: str) -> str:
    from edgefl_protocol import codec
    return codec.AUTO if text == codec.AUTO else _codec(text)


def _checked_by(check):  # noqa: ANN001, ANN202
    """An argparse type that keeps the text once `check(text)` accepts it (its ValueError is the message)."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return parse


def _name(text: str) -> str:
    try:
        return topics.check_name("federation", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol import (
        algorithms,  # imports torch: only when a command needs it
    )
    defaults = RoundSettings()  # simulate's defaults are the runtime's (README: "Field benchmark")

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
    sim.add_argument("--config", type=Path, default=None, metavar="FILE",
                     help="a coordinator config (broker_coordinator/settings/config.py): its [rounds] section is simulated "
                          "exactly, and only the round flags given on this command line override it")
    sim.add_argument("--agents", type=_bounded(int, 1, 500), default=10, help="number of agent processes")
    sim.add_argument("--rounds", type=_bounded(int, 1, 100000), default=20, help="federated rounds")
    sim.add_argument("--dataset", default="mnist5k",
                     help="mnist5k, digits, or synthetic[:ALPHA,BETA] (FedProx Synthetic, default 1,1)")
    sim.add_argument("--partition", type=_partition, default=None,
                     help="iid, dirichlet:A, shards:K or natural; default dirichlet:0.3 (natural for synthetic)")
    sim.add_argument("--partition-file", type=Path, default=None, metavar="NPZ",
                     help="use a saved partition instead: an .npz with train_idx and offsets, one client per "
                          "agent (e.g. bench/data/mnist5k_dir01_20clients.npz)")
    sim.add_argument("--model", default=None, metavar="NAME",
                     help="the model: a built-in (mnist_cnn, mnist_mlp, digits_mlp, logreg60) or your own as "
                          "package.module:factory, installed here (default: the dataset's model)")
    sim.add_argument("--task", choices=["classification", "regression"], default="classification",
                     help="what the model learns; regression trains with --loss and reports it as the metric")
    sim.add_argument("--loss", choices=["cross_entropy", "mse", "mae"], default=None,
                     help="default: cross_entropy for classification, mse for regression")
    sim.add_argument("--devices-dir", type=Path, default=None, metavar="DIR",
                     help="your own devices instead of --dataset: DIR/<device>.toml each with a [data] section "
                          "(source npz|csv|images|spool, path, ...: the agent config's); one agent per file")
    sim.add_argument("--test-data", type=Path, default=None, metavar="NPZ",
                     help="with --devices-dir: the coordinator's test set (x, y); without it the devices evaluate")
    sim.add_argument("--evaluate", choices=["auto", "central", "devices", "both"], default=defaults.evaluate,
                     help="where each round's model is evaluated: the coordinator's test set, the devices' "
                          "held-out slices (sample-weighted), both; auto = central when there is a test set")
    sim.add_argument("--eval-only-every", type=_bounded(int, 0), default=0, metavar="N",
                     help="every Nth round the devices only evaluate the model (no training); 0 = never")
    sim.add_argument("--holdout", type=_bounded(float, 0.0, 0.9), default=0.2,
                     help="with a built-in dataset, the fraction of each shard held out when devices evaluate")
    sim.add_argument("--algorithm", choices=sorted(algorithms.ALGORITHMS), default=defaults.algorithm)
    sim.add_argument("--hparam", action="append", default=[], metavar="KEY=VALUE", type=_hparam,
                     help="algorithm hyper-parameter over its defaults (repeatable), e.g. rho=0.1 or sam_every=4")
    sim.add_argument("--clients-per-round", type=_bounded(int, 0), default=0, help="0 = every online agent")
    sim.add_argument("--local-epochs", type=_bounded(int, 0, 1000), default=defaults.local_epochs,
                     help="local epochs per round; 0 = each agent chooses 3-8 from its measured speed and the deadline")
    sim.add_argument("--selection", choices=["random", "stability"], default="random",
                     help="cohort selection policy (stability: DR-SAM's, prefers low tau and high gamma)")
    sim.add_argument("--normalize-steps", action="store_true",
                     help="FedNova-style aggregation: normalize each delta by its local steps")
    sim.add_argument("--min-updates", type=_bounded(int, 1), default=1,
                     help="quorum: updates needed to close a round at its deadline")
    sim.add_argument("--batch-size", type=_bounded(int, 1, 100000), default=defaults.batch_size)
    sim.add_argument("--lr", type=_bounded(float, 1e-9, 100.0), default=defaults.lr, help="local learning rate")
    sim.add_argument("--momentum", type=_bounded(float, 0.0, 0.999), default=defaults.momentum,
                     help="local SGD momentum")
    sim.add_argument("--round-timeout", type=_bounded(float, 1.0), default=300.0,
                     help="seconds a round waits for updates")
    sim.add_argument("--codec", type=_uplink_codec, default=None,
                     help="uplink codec the tasks name, e.g. float32, q8, topk0.05+q8+zlib, or auto "
                          "(the default: topk0.1+q4c64+zlib for models of 10,000 parameters or more, "
                          "q4c64+zlib below)")
    sim.add_argument("--model-codec", type=_codec, default="float32",
                     help="downlink codec for the global model: float32 (lossless) or float16, optionally +zlib")
    sim.add_argument("--downlink", choices=["full", "delta"], default=defaults.downlink,
                     help="delta: devices holding a recent model get lossy deltas of it (--downlink-codec), "
                          "others the full model; full: every device fetches the whole model (default: %(default)s)")
    sim.add_argument("--downlink-codec", type=_codec, default=defaults.downlink_codec,
                     help="codec of the downlink deltas (default: %(default)s)")
    sim.add_argument("--downlink-chain", type=_bounded(int, 1, 64), default=defaults.downlink_chain,
                     help="versions whose deltas stay retained: a device further behind fetches the full model "
                          "(default: %(default)s)")
    sim.add_argument("--serve-average", type=_bounded(float, 0.0, 0.999), default=defaults.serve_average,
                     metavar="DECAY",
                     help="evaluate (and keep in the checkpoint) an exponential moving average of the global "
                          "models with this decay; devices still train from the last global model; 0 = serve "
                          "the last global model (default: %(default)s)")
    from broker_coordinator.settings.choices import AGGREGATORS
    sim.add_argument("--aggregator", choices=AGGREGATORS, default=defaults.aggregator,
                     help="the robust fold (broker_coordinator/aggregation/robust.py); centered_clip and mean stream and run "
                          "in sites too")
    sim.add_argument("--sites", type=_bounded(int, 0, 64), default=0, metavar="N",
                     help="the devices in N sites: a Mosquitto per site bridged to a central one, a site "
                          "aggregator beside each, devices dealt to sites in turn; 0 = a flat federation")
    sim.add_argument("--site-workers", type=_bounded(int, 1, 16), default=1, metavar="W",
                     help="with --sites: aggregator workers per site (sharing its updates through $share)")
    sim.add_argument("--mode", choices=["sync", "buffered"], default=defaults.mode,
                     help="sync: lock-step rounds; buffered: asynchronous FedBuff-style versions, --rounds of them "
                          "(see broker_coordinator/engine/buffered.py)")
    sim.add_argument("--buffer-size", type=_bounded(int, 1), default=defaults.buffer_size, metavar="K",
                     help="buffered: accepted updates per applied version")
    sim.add_argument("--max-staleness", type=_bounded(int, 0), default=defaults.max_staleness, metavar="S",
                     help="buffered: accept updates trained up to S versions ago; older ones are dropped")
    sim.add_argument("--staleness-weight", choices=["inverse_sqrt", "constant"], default=defaults.staleness_weight,
                     help="buffered: an update s versions old counts 1/sqrt(1+s) (inverse_sqrt) or 1")
    from broker_coordinator.settings.choices import SERVER_OPTIMIZERS
    sim.add_argument("--server-optimizer", choices=SERVER_OPTIMIZERS, default=defaults.server_optimizer,
                     help="applied to the server rule's step each round (Reddi et al.; "
                          "broker_coordinator/aggregation/server_optimizer.py); sgd at --server-lr 1 is the rule alone")
    sim.add_argument("--server-lr", type=_bounded(float, 1e-9, 10.0), default=None,
                     help="the server optimizer's rate (default: 1 for sgd, 1 - --server-momentum for momentum, "
                          "0.01 for adam and yogi, 0.1 for adagrad)")
    sim.add_argument("--server-lr-decay", type=_bounded(float, 1e-9, 1.0), default=defaults.server_lr_decay,
                     metavar="GAMMA", help="the server step size is multiplied by GAMMA after each applied step "
                                           "(default 1: fixed); a decaying step settles a noisy federation, and slows it")
    sim.add_argument("--server-momentum", type=_bounded(float, 0.0, 0.999), default=defaults.server_momentum)
    sim.add_argument("--beta1", type=_bounded(float, 0.0, 0.999), default=defaults.beta1,
                     help="adam, yogi, adagrad: the first moment's decay")
    sim.add_argument("--beta2", type=_bounded(float, 0.0, 0.9999), default=defaults.beta2,
                     help="adam, yogi: the second moment's decay")
    sim.add_argument("--tau", type=_bounded(float, 1e-12), default=defaults.tau, help="adaptivity of adam, yogi, adagrad")
    sim.add_argument("--tensorboard", default=None, metavar="DIR",
                     help="write each round to TensorBoard event files under DIR/RUN (needs pip install edgefl[tracking])")
    sim.add_argument("--mlflow", default=None, metavar="URI",
                     help="log the run to MLflow at this tracking URI, e.g. file:./mlruns (needs edgefl[tracking])")
    from broker_coordinator.simulation.fleet import parse_churn, parse_fleet
    sim.add_argument("--fleet", type=_checked_by(parse_fleet), default=None, metavar="CLASS:N,...",
                     help="emulate a mixed fleet, e.g. zero2w:4,pi3:4,pi4:8,pi5:4 (counts add up to --agents): "
                          "each agent process runs in its own cgroup with a CPU quota from its class's relative "
                          "training speed and a memory limit from its RAM (classes and sources: "
                          "broker_coordinator/simulation/fleet.py); needs root, else says what is missing and runs without")
    sim.add_argument("--fleet-cpu", type=_bounded(float, 0.0, 64.0), default=0.0, metavar="CORES",
                     help="CPU quota of the fastest class (pi5, speed 1.0); 0 = so that the fleet's quotas add up "
                          "to twice this machine's cores, at most 1")
    sim.add_argument("--churn", type=_checked_by(parse_churn), nargs="?", const="0.15:30", default=None, metavar="FRACTION[:SECONDS]",
                     help="devices go offline and come back: about FRACTION of the time offline, periods of "
                          "SECONDS on average (half stop and restart the agent, half freeze it); the schedule "
                          "comes from --seed. Without a value: 0.15:30")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--out", type=Path, default=Path("demo-out"), help="directory for results and run files")
    sim.add_argument("--federation", type=_name, default="sim")
    sim.add_argument("--broker-port", type=_bounded(int, 0, 65535), default=0, help="0 = a free port")
    sim.add_argument("--mosquitto", default=None, help="path to the mosquitto binary (default: search PATH, /usr/sbin)")
    sim.add_argument("--metrics-port", type=_bounded(int, 0, 65535), default=0,
                     help="serve Prometheus metrics on this loopback port (0 = off)")
    sim.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run = sub.add_parser("run", help="serve rounds for a real fleet, as configured (the systemd service runs this)",
                         description="Connect to the broker named in the config and run rounds until the "
                                     "configured count or SIGTERM. Resumes from the last checkpoint in state_dir.")
    default_config = "default /etc/edgefl/coordinator.toml or $EDGEFL_COORDINATOR_CONFIG"
    run.add_argument("--config", default=None,
                     help=f"coordinator TOML config (keys: broker_coordinator/settings/config.py; {default_config})")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    stat = sub.add_parser("status", help="show the federation at a glance: last round, devices, accuracy")
    stat.add_argument("--config", default=None, help=f"coordinator TOML config ({default_config})")
    stat.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    back = sub.add_parser("rollback", help="make an earlier round's kept checkpoint the live model",
                          description="Stop the coordinator first. The kept checkpoint of ROUND (the last "
                                      "[storage] keep_checkpoints rounds are kept) becomes the live one under a new "
                                      "model version; the next 'run' resumes at ROUND + 1. Later rounds stay in the "
                                      "history, marked by a rollback row.")
    back.add_argument("--config", default=None, help=f"coordinator TOML config ({default_config})")
    back.add_argument("--to", type=_bounded(int, 1), required=True, metavar="ROUND", help="the round to go back to")
    back.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    site = sub.add_parser("site-aggregator", help="aggregate a site's updates beside its broker (see sites.py)",
                          description="Task the site's devices for each site task, validate and fold their "
                                      "updates, and send one signed partial per round up the bridge. The config "
                                      "comes from 'broker-config --site NAME'.")
    site.add_argument("--config", required=True, help="the site's aggregator.toml")
    site.add_argument("--worker", type=_bounded(int, 0, 63), default=0,
                      help="this worker's index (0 also tasks the devices and reports presence)")
    site.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    from broker_coordinator.cli.operator_cli import add_operator_commands
    add_operator_commands(sub)
    parser.simulate_parser = sim  # type: ignore[attr-defined] (given_flags reads which flags were written)
    return parser


# simulate's round flags and the [rounds] keys they set (with --config, only flags given override it)
ROUND_FLAGS = {
    "algorithm": "algorithm", "clients_per_round": "clients_per_round", "local_epochs": "local_epochs",
    "batch_size": "batch_size", "lr": "lr", "momentum": "momentum", "round_timeout": "round_timeout",
    "selection": "selection", "min_updates": "min_updates", "normalize_steps": "normalize_steps",
    "model_codec": "model_codec", "serve_average": "serve_average", "hparam": "hparams", "evaluate": "evaluate",
    "eval_only_every": "eval_only_every", "mode": "mode", "buffer_size": "buffer_size",
    "max_staleness": "max_staleness", "staleness_weight": "staleness_weight", "downlink": "downlink",
    "downlink_codec": "downlink_codec", "downlink_chain": "downlink_chain", "codec": "codec",
    "aggregator": "aggregator", "server_optimizer": "server_optimizer", "server_lr": "server_lr",
    "server_lr_decay": "server_lr_decay",
    "server_momentum": "server_momentum", "beta1": "beta1", "beta2": "beta2", "tau": "tau",
}


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the options written on the command line (as --flag or --flag=value)."""
    words = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    sim = getattr(parser, "simulate_parser", None)
    actions = sim._actions if sim is not None else []  # argparse keeps its actions here, and exposes no getter
    return {action.dest for action in actions if words & set(action.option_strings)}


def round_settings(args: argparse.Namespace, given: set[str]):  # noqa: ANN201 (RoundSettings; torch import)
    """RoundSettings from --config's [rounds] (if any) with the given flags over it, else from the flags."""
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol.settings import build_section, read_toml
    flags = {key: (dict(getattr(args, dest)) if dest == "hparam" else getattr(args, dest))
             for dest, key in ROUND_FLAGS.items() if dest in given or not args.config}
    if flags.get("codec") is None:
        flags.pop("codec", None)
    if not args.config:
        return RoundSettings(**flags)
    from broker_coordinator.settings.privacy_settings import PrivacySettings
    raw = read_toml(args.config)
    privacy = build_section(PrivacySettings, raw.get("privacy", {}), f"{args.config} [privacy]")
    settings = build_section(RoundSettings, {**raw.get("rounds", {}), **flags, "privacy": privacy},
                             f"{args.config} [rounds]")
    return settings


def tracking_settings(args: argparse.Namespace):  # noqa: ANN201 (TrackingSettings)
    """[tracking] from --config (if any) with --tensorboard / --mlflow over it."""
    from broker_coordinator.settings.tracking_settings import TrackingSettings
    from edgefl_protocol.settings import build_section, read_toml
    table = dict(read_toml(args.config).get("tracking", {})) if args.config else {}
    table.update({key: getattr(args, key) for key in ("tensorboard", "mlflow") if getattr(args, key)})
    return build_section(TrackingSettings, table, f"{args.config or 'simulate'} [tracking]")


def run_simulate(args: argparse.Namespace, given: set[str] = frozenset()) -> int:
    from broker_coordinator.simulation.simulate import SimulationSpec, simulate

    if args.fleet:
        from broker_coordinator.simulation.fleet import assign
        assign(args.fleet, args.agents, args.seed)  # the counts must match --agents: say so before starting
    default_partition = "natural" if args.dataset.startswith("synthetic") else "dirichlet:0.3"
    spec = SimulationSpec(agents=args.agents, rounds=args.rounds, dataset=args.dataset,
                          partition=args.partition or default_partition, seed=args.seed, out=args.out,
                          federation=args.federation, broker_port=args.broker_port, mosquitto=args.mosquitto,
                          metrics_port=args.metrics_port, partition_file=args.partition_file, fleet=args.fleet, fleet_cpu=args.fleet_cpu,
                          churn=args.churn, model=args.model, task=args.task,
                          loss=args.loss or ("cross_entropy" if args.task == "classification" else "mse"),
                          devices_dir=args.devices_dir, test_data=args.test_data, holdout=args.holdout,
                          sites=args.sites, site_workers=args.site_workers)
    spec.tracking = tracking_settings(args)
    simulate(spec, round_settings(args, given), echo=lambda line: print(line, flush=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    from broker_coordinator.cli.operator_cli import (
        OPERATOR_COMMANDS,
        build_operator_parser,
    )
    argv = sys.argv[1:] if argv is None else argv
    # operator commands need no torch: parse them without the simulate parser's imports
    parser = build_operator_parser() if argv[:1] and argv[0] in OPERATOR_COMMANDS else build_parser()
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
    from models.datasets import DatasetError

    errors: tuple[type[BaseException], ...] = (BrokerError, BrokerUnavailable, ConfigError, DatasetError,
                                               RegistryError, StateLocked, StoreError, ValueError, TimeoutError,
                                               OSError)
    if not hasattr(args, "run"):  # the operator commands (args.run) do without torch
        from broker_coordinator.engine.coordinator import RoundFailed
        errors += (RoundFailed,)
    try:
        if args.command == "simulate":
            return run_simulate(args, given_flags(parser, argv))
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
