"""A probe, not a benchmark of record: where `dynsam`'s late decline on the cheap settings comes from.
Runs `dynsam` and FedAvg with SGD through bench/fedsim.py (the shipped engine in process) on one of
bench/settings.py's settings, seeds 1-3, with one thing changed, and prints each row's final accuracy
of the served model and its worst final-minus-best. What it measured is in docs/RESEARCH.md ("Probes"
and "The default across settings").

    python -m research.probe_dual --setting synthetic1,1_30clients               # as shipped
    python -m research.probe_dual --epochs 2                                     # fixed local epochs
    python -m research.probe_dual --dynsam dual=0                                # a dynsam hyper-parameter
    python -m research.probe_dual --dual-decay 0.9                               # h_k and H shrink by 0.9 a round
    python -m research.probe_dual --dynsam dual_decay=0.95                       # the shipped leaky dual

`--dual-decay` patches FedDyn's dual in this process only (the client's h_k <- beta h_k + delta and the
server's H <- beta H + share x mean delta, so the two stay in step); it is not a shipped option.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor

import numpy as np

SERVED = "0.75"  # the shipped serve_average


def decay_the_dual(beta: float) -> None:
    from edgefl_protocol.algorithms.feddyn import DualServer, DualState
    new_global = DualServer.new_global

    def decayed_new_global(self, global_params, mean_delta, mean_extras=None):  # noqa: ANN001
        if self.H is not None:
            for name in self.H:
                self.H[name] *= beta
        return new_global(self, global_params, mean_delta, mean_extras)

    def decayed_committed(self, sent) -> None:  # noqa: ANN001
        super(DualState, self).committed(sent)
        if getattr(self, "dual", None) is not None:
            self.state["h"] = [beta * h.numpy() + np.asarray(sent[name], dtype=np.float32)
                               for h, name in zip(self.dual, self.param_names)]

    DualServer.new_global = decayed_new_global
    DualState.committed = decayed_committed


def one(job: tuple) -> tuple:
    setting, algorithm, seed, args = job
    from bench import fedsim, settings
    from bench.algorithms import ROUND_TIMEOUT, fleet_for
    from bench.field_settings import VARIANTS
    from broker_coordinator.settings.round_settings import RoundSettings
    fedsim.set_threads(1)
    if args.dual_decay != 1.0:
        decay_the_dual(args.dual_decay)
    fed = settings.SETTINGS[setting]()
    if args.validation:  # choose on held-out training data, never on the test set the field rows report
        fed.clients, fed.test = fedsim.split_validation(fed.clients)
    variant = VARIANTS[algorithm]
    hparams = {**dict(variant.hparams), **(dict(args.dynsam) if algorithm == "dynsam" else {})}
    rs = RoundSettings(algorithm=variant.algorithm, clients_per_round=fed.clients_per_round, hparams=hparams,
                       round_timeout=ROUND_TIMEOUT, local_epochs=args.epochs, lr_decay=args.lr_decay,
                       **({"aggregator": args.aggregator} if args.aggregator else {}))
    curve = fedsim.run(fed, rs, seed=seed, fleet=fleet_for(len(fed.clients), seed)).ema_accuracy[args.served]
    return algorithm, seed, 100 * curve[-1], 100 * (curve[-1] - max(curve))


def hparam(text: str) -> tuple[str, float | str]:
    key, _, value = text.partition("=")
    try:
        return key, float(value)
    except ValueError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", default="synthetic1,1_30clients")
    ap.add_argument("--epochs", type=int, default=0, help="[rounds] local_epochs (0: device-chosen, shipped)")
    ap.add_argument("--lr-decay", type=float, default=0.998, help="[rounds] lr_decay (shipped: 0.998)")
    ap.add_argument("--aggregator", default="", help="[rounds] aggregator (default: the shipped fold)")
    ap.add_argument("--dynsam", type=hparam, action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dual-decay", type=float, default=1.0,
                    help="the first probe's leak, applied once per participation (not the shipped "
                         "`dual_decay` hyper-parameter, which decays every round: --dynsam dual_decay=B)")
    ap.add_argument("--served", default=SERVED, choices=("0.5", "0.75", "0.9"),
                    help="the serve_average decay whose model is scored")
    ap.add_argument("--algorithms", default="dynsam,fedavg")
    ap.add_argument("--validation", action="store_true",
                    help="score on a validation split (20%% of each client's training data) instead of the test set")
    ap.add_argument("--seeds", default="1,2,3")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(args.setting, a, s, args) for a in args.algorithms.split(",") for s in seeds]
    rows: dict[str, list[tuple[float, float]]] = {}
    with ProcessPoolExecutor(2) as pool:
        for algorithm, _, final, decline in pool.map(one, jobs):
            rows.setdefault(algorithm, []).append((final, decline))
    for algorithm, runs in rows.items():
        print(f"{algorithm}+sgd: final {statistics.mean(f for f, _ in runs):.2f}% "
              f"({', '.join(f'{f:.1f}' for f, _ in runs)}), worst final-best {min(d for _, d in runs):+.2f}, "
              f"median {statistics.median(d for _, d in runs):+.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
