"""`broker-coordinator simulate`: its options and its handler. The one part of the command that
imports simulation code; `cli` imports it only when the command is `simulate`."""

from __future__ import annotations

import argparse
from pathlib import Path

from broker_coordinator.cli.arguments import (
    bounded,
    checked_by,
    codec_spec,
    federation_name,
    hparam,
    partition_spec,
    uplink_codec_spec,
)


def add_simulate_arguments(sim: argparse.ArgumentParser) -> None:
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol import (
        algorithms,  # imports torch: only when a command needs it
    )
    defaults = RoundSettings()  # simulate's defaults are the runtime's

    sim.add_argument("--config", type=Path, default=None, metavar="FILE",
                     help="a coordinator config (docs/CONFIGURATION.md): its round sections ([schedule], [algorithm], "
                          "[fold], ...) are simulated exactly, and only the round flags given on this command line "
                          "override them")
    sim.add_argument("--agents", type=bounded(int, 1, 500), default=10, help="number of agent processes")
    sim.add_argument("--rounds", type=bounded(int, 1, 100000), default=20, help="federated rounds")
    sim.add_argument("--dataset", default="mnist5k",
                     help="mnist5k, digits, or synthetic[:ALPHA,BETA] (FedProx Synthetic, default 1,1)")
    sim.add_argument("--partition", type=partition_spec, default=None,
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
    sim.add_argument("--eval-only-every", type=bounded(int, 0), default=0, metavar="N",
                     help="every Nth round the devices only evaluate the model (no training); 0 = never")
    sim.add_argument("--holdout", type=bounded(float, 0.0, 0.9), default=0.2,
                     help="with a built-in dataset, the fraction of each shard held out when devices evaluate")
    sim.add_argument("--algorithm", choices=sorted(algorithms.ALGORITHMS), default=defaults.algorithm)
    sim.add_argument("--hparam", action="append", default=[], metavar="KEY=VALUE", type=hparam,
                     help="algorithm hyper-parameter over its defaults (repeatable), e.g. rho=0.1 or sam_every=4")
    sim.add_argument("--clients-per-round", type=bounded(int, 0), default=0, help="0 = every online agent")
    sim.add_argument("--local-epochs", type=bounded(int, 0, 1000), default=defaults.local_epochs,
                     help="local epochs per round; 0 = each agent chooses 3-8 from its measured speed and the deadline")
    sim.add_argument("--selection", choices=["random", "stability"], default="random",
                     help="cohort selection policy (stability: DR-SAM's, prefers low tau and high gamma)")
    sim.add_argument("--normalize-steps", action="store_true",
                     help="FedNova-style aggregation: normalize each delta by its local steps")
    sim.add_argument("--min-updates", type=bounded(int, 1), default=1,
                     help="quorum: updates needed to close a round at its deadline")
    sim.add_argument("--batch-size", type=bounded(int, 1, 100000), default=defaults.batch_size)
    sim.add_argument("--lr", type=bounded(float, 1e-9, 100.0), default=defaults.lr, help="local learning rate")
    sim.add_argument("--momentum", type=bounded(float, 0.0, 0.999), default=defaults.momentum,
                     help="local SGD momentum")
    sim.add_argument("--round-timeout", type=bounded(float, 1.0), default=300.0,
                     help="seconds a round waits for updates")
    sim.add_argument("--codec", type=uplink_codec_spec, default=None,
                     help="uplink codec the tasks name, e.g. float32, q8, topk0.05+q8+zlib, or auto "
                          "(the default: topk0.1+q4c64+zlib for models of 10,000 parameters or more, "
                          "q4c64+zlib below)")
    sim.add_argument("--model-codec", type=codec_spec, default="float32",
                     help="downlink codec for the global model: float32 (lossless) or float16, optionally +zlib")
    sim.add_argument("--downlink", choices=["full", "delta"], default=defaults.downlink,
                     help="delta: devices holding a recent model get lossy deltas of it (--downlink-codec), "
                          "others the full model; full: every device fetches the whole model (default: %(default)s)")
    sim.add_argument("--downlink-codec", type=codec_spec, default=defaults.downlink_codec,
                     help="codec of the downlink deltas (default: %(default)s)")
    sim.add_argument("--downlink-chain", type=bounded(int, 1, 64), default=defaults.downlink_chain,
                     help="versions whose deltas stay retained: a device further behind fetches the full model "
                          "(default: %(default)s)")
    sim.add_argument("--serve-average", type=bounded(float, 0.0, 0.999), default=defaults.serve_average,
                     metavar="DECAY",
                     help="evaluate (and keep in the checkpoint) an exponential moving average of the global "
                          "models with this decay; devices still train from the last global model; 0 = serve "
                          "the last global model (default: %(default)s)")
    sim.add_argument("--serving", choices=["served", "last", "off"], default="off",
                     help="publish each version the coordinator vouches for to the devices' serving stores "
                          "(DEVICE/state/serving), as 'run' does with [serving] publish (default: %(default)s)")
    from broker_coordinator.settings.choices import AGGREGATORS
    sim.add_argument("--aggregator", choices=AGGREGATORS, default=defaults.aggregator,
                     help="the robust fold (broker_coordinator/aggregation/robust.py); centered_clip and mean stream and run "
                          "in sites too")
    sim.add_argument("--sites", type=bounded(int, 0, 64), default=0, metavar="N",
                     help="the devices in N sites: a Mosquitto per site bridged to a central one, a site "
                          "aggregator beside each, devices dealt to sites in turn; 0 = a flat federation")
    sim.add_argument("--site-workers", type=bounded(int, 1, 16), default=1, metavar="W",
                     help="with --sites: aggregator workers per site (sharing its updates through $share)")
    sim.add_argument("--mode", choices=["sync", "buffered"], default=defaults.mode,
                     help="sync: lock-step rounds; buffered: asynchronous FedBuff-style versions, --rounds of them "
                          "(see broker_coordinator/engine/buffered.py)")
    sim.add_argument("--buffer-size", type=bounded(int, 1), default=defaults.buffer_size, metavar="K",
                     help="buffered: accepted updates per applied version")
    sim.add_argument("--max-staleness", type=bounded(int, 0), default=defaults.max_staleness, metavar="S",
                     help="buffered: accept updates trained up to S versions ago; older ones are dropped")
    sim.add_argument("--staleness-weight", choices=["inverse_sqrt", "constant"], default=defaults.staleness_weight,
                     help="buffered: an update s versions old counts 1/sqrt(1+s) (inverse_sqrt) or 1")
    from broker_coordinator.settings.choices import SERVER_OPTIMIZERS
    sim.add_argument("--server-optimizer", choices=SERVER_OPTIMIZERS, default=defaults.server_optimizer,
                     help="applied to the server rule's step each round (Reddi et al.; "
                          "broker_coordinator/aggregation/server_optimizer.py); sgd at --server-lr 1 is the rule alone")
    sim.add_argument("--server-lr", type=bounded(float, 1e-9, 10.0), default=None,
                     help="the server optimizer's rate (default: 1 for sgd, 1 - --server-momentum for momentum, "
                          "0.01 for adam and yogi, 0.1 for adagrad)")
    sim.add_argument("--server-lr-decay", type=bounded(float, 1e-9, 1.0), default=defaults.server_lr_decay,
                     metavar="GAMMA", help="the server step size is multiplied by GAMMA after each applied step "
                                           "(default 1: fixed); a decaying step settles a noisy federation, and slows it")
    sim.add_argument("--server-momentum", type=bounded(float, 0.0, 0.999), default=defaults.server_momentum)
    sim.add_argument("--beta1", type=bounded(float, 0.0, 0.999), default=defaults.beta1,
                     help="adam, yogi, adagrad: the first moment's decay")
    sim.add_argument("--beta2", type=bounded(float, 0.0, 0.9999), default=defaults.beta2,
                     help="adam, yogi: the second moment's decay")
    sim.add_argument("--tau", type=bounded(float, 1e-12), default=defaults.tau, help="adaptivity of adam, yogi, adagrad")
    sim.add_argument("--tensorboard", default=None, metavar="DIR",
                     help="write each round to TensorBoard event files under DIR/RUN (needs pip install edgefl[tracking])")
    sim.add_argument("--mlflow", default=None, metavar="URI",
                     help="log the run to MLflow at this tracking URI, e.g. file:./mlruns (needs edgefl[tracking])")
    from broker_coordinator.simulation.fleet import parse_churn, parse_fleet
    sim.add_argument("--fleet", type=checked_by(parse_fleet), default=None, metavar="CLASS:N,...",
                     help="emulate a mixed fleet, e.g. zero2w:4,pi3:4,pi4:8,pi5:4 (counts add up to --agents): "
                          "each agent process runs in its own cgroup with a CPU quota from its class's relative "
                          "training speed and a memory limit from its RAM (classes and sources: "
                          "broker_coordinator/simulation/fleet.py); needs root, else says what is missing and runs without")
    sim.add_argument("--fleet-cpu", type=bounded(float, 0.0, 64.0), default=0.0, metavar="CORES",
                     help="CPU quota of the fastest class (pi5, speed 1.0); 0 = so that the fleet's quotas add up "
                          "to twice this machine's cores, at most 1")
    sim.add_argument("--churn", type=checked_by(parse_churn), nargs="?", const="0.15:30", default=None, metavar="FRACTION[:SECONDS]",
                     help="devices go offline and come back: about FRACTION of the time offline, periods of "
                          "SECONDS on average (half stop and restart the agent, half freeze it); the schedule "
                          "comes from --seed. Without a value: 0.15:30")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--out", type=Path, default=Path("demo-out"), help="directory for results and run files")
    sim.add_argument("--federation", type=federation_name, default="sim")
    sim.add_argument("--broker-port", type=bounded(int, 0, 65535), default=0, help="0 = a free port")
    sim.add_argument("--mosquitto", default=None, help="path to the mosquitto binary (default: search PATH, /usr/sbin)")
    sim.add_argument("--metrics-port", type=bounded(int, 0, 65535), default=0,
                     help="serve Prometheus metrics on this loopback port (0 = off)")
    sim.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


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
    """RoundSettings from --config's round sections (if any) with the given flags over them, else from the flags."""
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol.settings import read_toml
    flags = {key: (dict(getattr(args, dest)) if dest == "hparam" else getattr(args, dest))
             for dest, key in ROUND_FLAGS.items() if dest in given or not args.config}
    if flags.get("codec") is None:
        flags.pop("codec", None)
    if not args.config:
        return RoundSettings(**flags)
    from broker_coordinator.settings.round_config import read_rounds
    return read_rounds(read_toml(args.config), str(args.config), overrides=flags)


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
                          sites=args.sites, site_workers=args.site_workers, serving=args.serving)
    spec.tracking = tracking_settings(args)
    simulate(spec, round_settings(args, given), echo=lambda line: print(line, flush=True))
    return 0
