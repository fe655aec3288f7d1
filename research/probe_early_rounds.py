"""A probe: how far below the clean run 20% attackers put the served model in the first rounds, and
how much of that any defence could win back. Through `bench.attacks`' federation (MNIST-5k
Dirichlet(0.5), 20 devices, the MLP) with the shipped fold, rounds 1-5, three runs per attack and seed:

- clean: no attackers;
- attacked: the attack as `bench.attacks` runs it;
- dropped: the same attackers, cohorts and data, their updates taken out before the fold sees them,
  what a perfect filter would leave: the attackers' data is still missing from the step.

`dropped`'s early gap is the floor of the issue's measure (clean minus attacked, the largest over
rounds 2-5) on this bench. What it measured is in docs/RESEARCH.md, "Robust aggregation".

    python -m research.probe_early_rounds sign_flip@0.2,inflated_count@0.2 1,2
"""

from __future__ import annotations

import sys
from unittest import mock

from bench import attacks, inmemory
from bench.algorithms import fleet_for
from bench.attacks_report import EARLY, FOLDS, HEADLINE, ROUND_TIMEOUT
from bench.settings import dirichlet05
from broker_coordinator.settings.round_settings import RoundSettings

ROUNDS = max(EARLY)


def served(run: str, seed: int, dropped: bool = False) -> list[float]:
    fed = dirichlet05()
    fed.arch = attacks.ARCH[HEADLINE]
    settings = RoundSettings(clients_per_round=fed.clients_per_round, round_timeout=ROUND_TIMEOUT,
                             **FOLDS["centered_clip"])
    devices = [f"dev-{i:03d}" for i in range(len(fed.clients))]
    attack, _, fraction = run.partition("@")
    bad = attacks.attackers_of(float(fraction), devices, seed) if fraction else set()
    plan = attacks.Attack(attack, bad, seed)
    sim = inmemory.InMemoryFederation(fed.arch, fed.clients, fed.test, settings, seed, fed.clients_per_round,
                                      fleet=fleet_for(len(fed.clients), seed), data_of=plan.data_of,
                                      tamper=plan.tamper)
    plan.coordinator = sim.coordinator
    fold = inmemory.fold_round
    honest_only = (lambda engine, answers, round_no: fold(engine, {d: p for d, p in answers.items() if d not in bad},
                                                          round_no))
    accuracy: list[float] = []
    with mock.patch.object(inmemory, "fold_round", honest_only if dropped else fold):
        for round_no in range(1, ROUNDS + 1):
            record = sim.round(round_no)  # None: nothing folded (a cohort of attackers only, dropped)
            accuracy.append(100 * record.accuracy if record else (accuracy[-1] if accuracy else 0.0))
    return accuracy


def main(runs: list[str], seeds: list[int]) -> None:
    inmemory.set_threads(1)
    for seed in seeds:
        clean = served("clean", seed)
        print(f"seed {seed} clean: " + " ".join(f"{a:.1f}" for a in clean), flush=True)
        for run in runs:
            for label, accuracy in (("attacked", served(run, seed)), ("dropped", served(run, seed, True))):
                gap = max(clean[r - 1] - accuracy[r - 1] for r in EARLY)
                print(f"seed {seed} {run} {label}: " + " ".join(f"{a:.1f}" for a in accuracy)
                      + f"; early gap {gap:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), [int(s) for s in sys.argv[2].split(",")])
