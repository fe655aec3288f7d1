"""The design and tuning runs of the default algorithm, on a validation split
(20% of every client's training data, pooled; the test set is never used).

Baselines keep the hyper-parameters of the peer measurement (bench/README.md:
rho 0.05, mu 0.1, alpha 0.1) and are run here only as reference points; the
default's shared hyper-parameters (alpha 0.1, rho 0.05) are those same values.
What was chosen on these runs: the default's sam_every k, and which of its
components stay on (signal adaptation, size-aware alpha, weighting).
"""

from __future__ import annotations

from .algorithms import MOMENTUM, Job, Variant
from .settings import HEADLINE

DESIGNS = [
    Variant("dynsam-k2", "dynsam", (("sam_every", 2),)),
    Variant("dynsam-k1", "dynsam", (("sam_every", 1),)),
    Variant("dynsam-k4", "dynsam", (("sam_every", 4),)),
    Variant("dynsam-k0", "dynsam", (("sam_every", 0),)),
    Variant("dynsam-no_adapt", "dynsam", (("adapt_rho", 0), ("adapt_alpha", 0))),
    Variant("dynsam-size_aware", "dynsam", (("size_aware", 1),)),
    Variant("dynsam-size_weighted", "dynsam", (("weighting", "size"),)),
]
REFERENCES = [Variant("fedavg", "fedavg"), Variant("feddyn", "feddyn"), Variant("fedsmoo", "fedsmoo"),
              Variant("fedsam", "fedsam")]


def validation_jobs() -> list[Job]:
    return [Job(HEADLINE, v, MOMENTUM, 0, split="validation") for v in DESIGNS + REFERENCES]
