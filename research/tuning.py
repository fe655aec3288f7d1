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

    python -m research.tuning            # the runs not cached yet, then algorithms_validation.{json,md}
    python -m research.tuning --report   # the report only, from the cached runs
"""

from __future__ import annotations

from bench.algorithm_jobs import MOMENTUM, Job, Variant
from bench.settings import HEADLINE

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


def main(argv: list[str] | None = None) -> int:
    """Run the validation jobs not cached yet (bench/algorithms.py's runner and cache), then write
    bench/results/algorithms_validation.{json,md} and its plot from every cached one."""
    import argparse
    import json

    from bench.algorithms import ABLATION, BASELINES, CPU_SIZED, DEFAULT, RESULTS, run_all
    from bench.algorithms_report import report
    from edgefl_protocol import algorithms

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only rebuild the report from cached runs")
    args = p.parse_args(argv)
    jobs = validation_jobs()
    if not args.report:
        run_all(jobs, args.workers)
    records = [json.loads(j.path.read_text()) for j in jobs if j.path.exists()]
    records = [r for r in records if "accuracy" in r]
    variants = {v.name: v for v in BASELINES + [DEFAULT] + CPU_SIZED + ABLATION}
    variants.update({r["variant"]: Variant(r["variant"], r["algorithm"], tuple(r["hparams"].items())) for r in records})
    report(records, variants, DEFAULT.name, RESULTS, "algorithms_validation",
           runtime_default=algorithms.DEFAULT_ALGORITHM)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
