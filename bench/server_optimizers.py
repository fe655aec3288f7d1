"""Server optimizers on every algorithm, small and in process: what each combination does, not which wins.

The shipped engine without a broker (`bench.inmemory`: the agent's local training, the coordinator's
intake, fold, server rule and server optimizer) on digits (`digits_mlp`, 10 clients, Dirichlet 0.3,
all 10 per round, 1 local epoch, float32 updates), 20 rounds, seeds 1-2. Rows: fedavg, feddyn and
dynsam, each with the server optimizers at their rates for an unset server_lr, and momentum also at
server_momentum 0.5. It answers one question the docs need: what a server optimizer does on top
of a server rule that already carries state (FedDyn's and DynSAM's dual H).

    python -m bench.server_optimizers            # bench/results/server_optimizers.json, .md (a few minutes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from . import provenance
from .inmemory import InMemoryFederation, set_threads

RESULTS = Path(__file__).resolve().parent / "results"
ALGORITHMS = ("fedavg", "feddyn", "dynsam")
OPTIMIZERS = {"sgd": {}, "momentum": {}, "momentum@mu0.5": {"server_momentum": 0.5}, "adam": {}, "yogi": {},
              "adagrad": {}}
ROUNDS, CLIENTS, PARTITION = 20, 10, "dirichlet:0.3"


def run(algorithm: str, optimizer: str, seed: int) -> list[float]:
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_models import datasets, partition
    data = datasets.load("digits")
    clients = [data.train.subset(p) for p in partition.split(PARTITION, data.train.y, CLIENTS, 0)]
    settings = RoundSettings(algorithm=algorithm, local_epochs=1, codec="float32",
                             server_optimizer=optimizer.partition("@")[0], **OPTIMIZERS[optimizer])
    fed = InMemoryFederation("digits_mlp", clients, data.test, settings, seed=seed, clients_per_round=CLIENTS)
    accuracy = []
    for round_no in range(1, ROUNDS + 1):
        record = fed.round(round_no)
        accuracy.append(record.accuracy if record else (accuracy[-1] if accuracy else 0.0))
    return accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    set_threads(1)
    rows: dict[str, dict] = {}
    for algorithm in ALGORITHMS:
        for optimizer in OPTIMIZERS:
            curves = [run(algorithm, optimizer, seed) for seed in seeds]
            final = [round(100 * c[-1], 1) for c in curves]
            best = [round(100 * max(c), 1) for c in curves]
            rows[f"{algorithm}+{optimizer}"] = {"final_accuracy": final, "best_accuracy": best, "seeds": seeds,
                                                "curves": [[round(100 * a, 1) for a in c] for c in curves]}
            print(f"{algorithm}+{optimizer}: final {final}, best {best}", flush=True)
    from broker_coordinator.settings.round_settings import RoundSettings
    result = {"runs": rows, "measured_with": provenance.measured_with(
        provenance.invoked(), {k: v for k, v in provenance.deciding(RoundSettings(codec="float32", local_epochs=1)).items()
                               if k not in ("algorithm", "server_optimizer", "server_lr")},
        varies={"algorithm": list(ALGORITHMS), "server_optimizer": list(OPTIMIZERS),
                "server_lr": "each optimizer's default (RoundSettings.server_step_size)"},
        data="digits", partition=f"{PARTITION} of {CLIENTS} clients (seed 0)", rounds=ROUNDS,
        engine="in process (bench/inmemory.py), no broker")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "server_optimizers.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Server optimizers on every algorithm (small, in process)", "",
             f"`python -m bench.server_optimizers` (bench/server_optimizers.py): digits, {CLIENTS} clients "
             f"({PARTITION}), all per round, 1 local epoch, float32 updates, {ROUNDS} rounds, seeds "
             f"{', '.join(map(str, seeds))}; each server optimizer at its rate for an unset server_lr. Test accuracy in %, "
             "mean of the seeds (final / best of the run).", "",
             "| algorithm | " + " | ".join(OPTIMIZERS) + " |", "|---|" + "---|" * len(OPTIMIZERS)]
    for algorithm in ALGORITHMS:
        cells = [f"{statistics.mean(rows[f'{algorithm}+{o}']['final_accuracy']):.1f} / "
                 f"{statistics.mean(rows[f'{algorithm}+{o}']['best_accuracy']):.1f}" for o in OPTIMIZERS]
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
    lines += ["", "A small problem and two seeds: it shows what a combination does (converges, oscillates), "
              "not which is best in the field.", ""]
    (RESULTS / "server_optimizers.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
