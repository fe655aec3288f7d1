"""The design and tuning runs of the default algorithm, on a validation split
(20% of every client's training data, pooled; the test set is never used).

Baselines keep the hyper-parameters of the peer measurement (DRSAM.md section 8:
rho 0.05, mu 0.1, alpha 0.1) and are run here only as reference points; the
default's shared hyper-parameters (alpha 0.1, rho 0.05) are those same values.

Session 1 chose the default's sam_every k (one seed, momentum): `K_CHOICE`.
Session 2 asked whether FedSMOO's global perturbation belongs in the default
and whether serving an average of the global models pays (two seeds, both
optimizers): `CONSENSUS_CHOICE`. A single final accuracy on 800 validation
images moves by about 0.7 points between identical runs, so the choices read the
mean validation accuracy over the last 10 rounds (`tail_mean`).
"""

from __future__ import annotations

from .algorithm_jobs import MOMENTUM, Job, Variant
from .settings import HEADLINE

K_CHOICE = [
    Variant("dynsam-k2", "dynsam", (("sam_every", 2),)),
    Variant("dynsam-k1", "dynsam", (("sam_every", 1),)),
    Variant("dynsam-k4", "dynsam", (("sam_every", 4),)),
    Variant("dynsam-k0", "dynsam", (("sam_every", 0),)),
]
CONSENSUS_CHOICE = [
    Variant("dynsam-v2", "dynsam", (("global_perturbation", 0),)),
    Variant("dynsam-gp", "dynsam", (("global_perturbation", 1),)),
    Variant("fedsmoo", "fedsmoo"),
    Variant("feddyn", "feddyn"),
    Variant("dynsam-bal", "dynsam", (("balanced_loss", 1),)),
]
TAIL = 10


def tail_mean(curve: list[float], rounds: int = TAIL) -> float:
    return sum(curve[-rounds:]) / len(curve[-rounds:])


def validation_jobs() -> list[Job]:
    jobs = [Job(HEADLINE, v, MOMENTUM, 0, split="validation") for v in K_CHOICE]
    jobs += [Job(HEADLINE, v, m, s, split="validation")
             for s in (0, 1) for m in (MOMENTUM, 0.0) for v in CONSENSUS_CHOICE]
    return jobs
