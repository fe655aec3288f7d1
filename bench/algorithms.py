"""Algorithm benchmark (a benchmark, not a test): every algorithm on the same
partition, model, batch, learning rate, fleet and seeds, with plain SGD and with
SGD + momentum 0.9, in process through the shipped engine (bench/fedsim.py).

Every RoundSettings key the benchmark does not vary is the shipped default (codec,
weighting, norm bound, aggregator, local_epochs = 0): each device plans its epochs
from its emulated speed and the deadline, on the demo's fleet mix (`make demo`:
DEMO_FLEET, scaled to the number of clients) with the demo's 6 s round timeout.

    python -m bench.algorithms --only headline --optimizers sgd --seeds 2   # what algorithms.json holds
    python -m bench.algorithms                 # headline + other settings + ablation (many hours on 2 cores)
    python -m bench.algorithms --quick         # a smoke version, under 3 minutes
    python -m bench.algorithms --report        # rebuild json/markdown/plots from cached runs

The design runs on a validation split (`python -m research.tuning`) and the in-process vs
`broker-coordinator simulate` comparison (`python -m research.mqtt_check`) use this runner and cache.

Each run is cached in bench/results/algorithms_runs/PIPELINE/ (resumable; runs of
the older pipeline, plain mean and 2 fixed epochs in float32, sit beside it and are
never read); the report
writes bench/results/algorithms.json (schema of issue 3), algorithms.md,
algorithms_details.json and algorithms_<setting>.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

from edgefl_protocol import algorithms

from .algorithm_jobs import MOMENTUM, PIPELINE, RESULTS, RUNS, Job, Variant  # noqa: F401 (used from here)
from .algorithms_report import report

DEMO_FLEET = "zero2w:2,pi3:2,pi4:4,pi5:2"  # the Makefile's DEMO_FLEET, for 10 devices
ROUND_TIMEOUT = 6.0  # seconds: what `make demo` passes (--round-timeout 6); caps slow devices' epochs


def fleet_spec(n_clients: int) -> str:
    """The demo's mix for `n_clients` devices (every count times n_clients / 10)."""
    from broker_coordinator.simulation.fleet import parse_fleet

    mix = parse_fleet(DEMO_FLEET)
    size = sum(n for _, n in mix)
    if n_clients % size:
        raise ValueError(f"{n_clients} clients cannot carry the demo's fleet mix {DEMO_FLEET} in proportion")
    return ",".join(f"{name}:{n * n_clients // size}" for name, n in mix)


def fleet_for(n_clients: int, seed: int) -> list[str]:
    """One device class per client: the demo's mix, shuffled with the run's seed."""
    from broker_coordinator.simulation.fleet import assign

    return [c.name for c in assign(fleet_spec(n_clients), n_clients, seed)]


BASELINES = [
    Variant("fedavg", "fedavg", note="size-weighted"),
    Variant("fedprox", "fedprox"),
    Variant("fedsam", "fedsam", note="full SAM"),
    Variant("feddyn", "feddyn"),
    Variant("fedsmoo", "fedsmoo", note="full SAM"),
    Variant("drsam", "drsam", note="faithful to DRSAM.md, full SAM"),
]
DEFAULT = Variant("dynsam", "dynsam", note="CPU-sized (sam_every=4)")
CPU_SIZED = [  # every SAM-family algorithm in its CPU-sized mode (ascent reused, refreshed every 4th step)
    Variant("fedsam-cpu", "fedsam", (("sam_every", 4),), "CPU-sized (sam_every=4)"),
    Variant("fedsmoo-cpu", "fedsmoo", (("sam_every", 4),), "CPU-sized (sam_every=4)"),
    Variant("drsam-cpu", "drsam", (("sam_every", 4),), "CPU-sized (sam_every=4)"),
]
ABLATION = [
    Variant("dynsam-full", "dynsam", (("sam_every", 1),), "full SAM instead of CPU-sized"),
    Variant("dynsam-no_adapt", "dynsam", (("adapt_rho", 0), ("adapt_alpha", 0)), "no signals: fixed rho, alpha"),
    Variant("dynsam-no_sam", "dynsam", (("sam", 0),), "no SAM"),
    Variant("dynsam-no_dual", "dynsam", (("dual", 0),), "no dual (no drift correction)"),
]


def run_measured_with(record: dict) -> dict:
    """A cached run's own `measured_with`: its commit, command and what decides its numbers."""
    return {"commit": record.get("commit", "unknown"), "command": record.get("command") or "python -m bench.algorithms",
            **record["deciding"], "data": record["setting"], "split": record["split"], "seeds": [record["seed"]],
            "fleet": record["fleet"], "round_timeout": record["round_timeout"], "rounds": record["rounds"],
            "clients_per_round": record["clients_per_round"]}


def run_job(job: Job) -> dict:
    from broker_coordinator.settings.round_settings import RoundSettings

    from . import fedsim, inmemory, provenance, settings

    if job.path.exists():
        return json.loads(job.path.read_text())
    fedsim.set_threads(1)
    fed = settings.SETTINGS[job.setting]()
    if job.rounds:
        fed.rounds = job.rounds
    if job.split == "validation":
        fed.clients, fed.test = fedsim.split_validation(fed.clients)
    # only what the benchmark varies is set; everything else is the shipped default
    rs = RoundSettings(algorithm=job.variant.algorithm, clients_per_round=fed.clients_per_round,
                       momentum=job.momentum, hparams=dict(job.variant.hparams), round_timeout=ROUND_TIMEOUT,
                       server_optimizer=job.server or "sgd")
    fleet = fleet_for(len(fed.clients), job.seed)
    if job.host_speed:  # a run paired with a cached one measured at its own host's speed
        inmemory.pin_host_speed(fed.arch, job.host_speed)
    started = time.time()
    result = fedsim.run(fed, rs, seed=job.seed, keep_signals=True, fleet=fleet)
    record = {"setting": job.setting, "variant": job.variant.name, "algorithm": job.variant.algorithm,
              "hparams": dict(job.variant.hparams), "momentum": job.momentum, "seed": job.seed, "split": job.split,
              "deciding": provenance.deciding(rs), "round_timeout": rs.round_timeout,
              "fleet": fleet_spec(len(fed.clients)), "device_classes": fleet,
              "host_samples_per_s": inmemory.host_speed(fed.arch), "rounds": fed.rounds,
              "clients_per_round": fed.clients_per_round, "commit": provenance.commit(),
              "command": provenance.invoked(),
              "accuracy": result.accuracy, "served_accuracy": result.served_accuracy,
              "ema_accuracy": result.ema_accuracy, "loss": result.loss,
              "local_seconds": result.local_seconds, "signals": result.signals, "records": result.records,
              "wall_seconds": time.time() - started}
    record["measured_with"] = run_measured_with(record)
    job.path.parent.mkdir(parents=True, exist_ok=True)
    job.path.write_text(json.dumps(record))
    print(f"done {job.split}/{job.setting}/{job.key} seed {job.seed}: {100 * result.accuracy[-1]:.2f}% "
          f"({record['wall_seconds']:.0f} s)", flush=True)
    return record


def run_all(jobs: list[Job], workers: int) -> list[dict]:
    todo = [j for j in jobs if not j.path.exists()]
    print(f"{len(jobs)} runs, {len(todo)} to do, {workers} worker(s)", flush=True)
    if workers > 1 and len(todo) > 1:
        with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=4) as pool:
            list(pool.imap_unordered(run_job, todo))
    else:
        for job in todo:
            run_job(job)
    return [run_job(j) for j in jobs]


def main(argv: list[str] | None = None) -> int:
    from . import settings

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="headline setting, 5 rounds, 1 seed, momentum only")
    p.add_argument("--report", action="store_true", help="only rebuild the report from cached runs")
    p.add_argument("--seeds", type=int, default=3, help="seeds for the headline setting")
    p.add_argument("--other-seeds", type=int, default=3, help="seeds for the other settings")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated parts: headline,cpu,ablation,other")
    p.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--optimizers", default="sgd,momentum",
                   help="comma-separated: sgd (plain SGD), momentum (SGD + momentum 0.9)")
    p.add_argument("--settings", default="",
                   help="comma-separated settings for the 'other' part (default: all but the headline)")
    p.add_argument("--rounds", type=int, default=0,
                   help="stop after this many rounds (a timing run, cached apart and not reported)")
    args = p.parse_args(argv)

    every = BASELINES + [DEFAULT] + CPU_SIZED + ABLATION
    variants = {v.name: v for v in every}
    if args.quick:
        jobs = [Job(settings.HEADLINE, v, MOMENTUM, 1, split="quick", rounds=5) for v in BASELINES + [DEFAULT]]
        for job in jobs:  # always a fresh measurement
            job.path.unlink(missing_ok=True)
        records = run_all(jobs, args.workers)
        report(records, variants, DEFAULT.name, RESULTS, "algorithms_quick", headline=settings.HEADLINE,
               runtime_default=algorithms.DEFAULT_ALGORITHM)
        return 0
    parts = set(args.only.split(",")) if args.only else {"headline", "cpu", "ablation", "other"}
    unknown = parts - {"headline", "cpu", "ablation", "other"}
    if unknown:
        p.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}; choose from headline,cpu,ablation,other")
    optimizers = {"sgd": 0.0, "momentum": MOMENTUM}
    wrong = set(args.optimizers.split(",")) - set(optimizers)
    if wrong:
        p.error(f"--optimizers: unknown {', '.join(sorted(wrong))}; choose from sgd,momentum")
    momenta = [optimizers[o] for o in args.optimizers.split(",")]
    others = args.settings.split(",") if args.settings else [settings.SYNTHETIC, settings.DIRICHLET05]
    wrong = set(others) - set(settings.SETTINGS)
    if wrong:
        p.error(f"--settings: unknown {', '.join(sorted(wrong))}; known: {', '.join(settings.SETTINGS)}")
    jobs: list[Job] = []
    seeds = range(1, args.seeds + 1)
    rounds = args.rounds or None
    if "headline" in parts:
        jobs += [Job(settings.HEADLINE, v, m, s, rounds=rounds) for s in seeds for m in momenta
                 for v in BASELINES + [DEFAULT]]
    if "cpu" in parts and MOMENTUM in momenta:
        jobs += [Job(settings.HEADLINE, v, MOMENTUM, s, rounds=rounds) for s in seeds for v in CPU_SIZED]
    if "ablation" in parts:
        jobs += [Job(settings.HEADLINE, v, m, s, rounds=rounds) for s in seeds for m in momenta for v in ABLATION]
    if "other" in parts:
        for setting in others:
            jobs += [Job(setting, v, m, s, rounds=rounds) for s in range(1, args.other_seeds + 1) for m in momenta
                     for v in BASELINES + [DEFAULT]]
    if args.variants:
        wanted = set(args.variants.split(","))
        unknown = wanted - set(variants)
        if unknown:
            p.error(f"unknown variant(s) {', '.join(sorted(unknown))}; known: {', '.join(variants)}")
        jobs = [j for j in jobs if j.variant.name in wanted]
    if not args.report:
        run_all(jobs, args.workers)
    if rounds:
        return 0  # a timing run: cached under test_r<rounds>, never reported
    records = [json.loads(path.read_text()) for path in sorted((RUNS / "test").glob("*/*.json"))]
    # the runs bench/field_settings.py adds to the same cache (server optimizers, its digits setting) are its own
    records = [r for r in records if "accuracy" in r and r["variant"] in variants
               and r.get("deciding", {}).get("server_optimizer", "sgd") == "sgd"
               and r["setting"] in (settings.HEADLINE, settings.DIRICHLET05, settings.SYNTHETIC)]
    report(records, variants, DEFAULT.name, RESULTS, ablation=ABLATION, headline=settings.HEADLINE,
           runtime_default=algorithms.DEFAULT_ALGORITHM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
