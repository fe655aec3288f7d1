"""The default chosen across settings (a benchmark, not a test): the same rows on three settings,
3 seeds each, through the shipped engine in process (bench/inmemory.py: the agent's training with
device-chosen epochs on the emulated fleet mix, the default codec with error feedback, signed updates,
the coordinator's intake, trust bounds, the default fold, the server rule and server optimizer).

Settings (bench/settings.py):
- the headline partition: MNIST-5k, Dirichlet(0.1) over 20 clients, the CNN;
- FedProx's Synthetic(1,1) over 30 devices, logistic regression;
- digits, 20 clients of 2 label-sorted shards each (the label-skewed one), the MLP.

A row is ALGORITHM+CLIENT[+SERVER]: CLIENT sgd or momentum (0.9), SERVER a [rounds] server_optimizer
at its default rate; ALGORITHM is one of the algorithms or `dynsam-leaky` (`dynsam` with the leaky dual,
dual_decay 0.96). The runs are made in the order that decides the default first: every algorithm
with SGD; the best headline row within the passes budget with each server optimizer; every algorithm
with momentum; FedAvg with each server optimizer (on the cheap settings already in the server phase).
A server optimizer's headline row gets seeds 2-3 only if its seed 1 ended within 5 points of the
row without it. Each finished run is cached (bench/results/algorithms_runs/pinned_speed/: every
emulated device trains at the pinned host speed of bench/host_speed.json times its class's, so a rerun
plans the same epochs) and the report is rebuilt after every run, so the job can be stopped and resumed
at any time.

    python -m bench.field_settings                   # the plan (hours on 2 cores; resumable)
    python -m bench.field_settings --phases sgd      # the SGD rows only
    python -m bench.field_settings --rows dynsam-leaky+sgd,fedavg+sgd   # some rows, every setting and seed
    python -m bench.field_settings --report          # rebuild from the cache

Writes bench/results/field_settings.md and field.json (its "fleet" part is `python -m bench.field`'s
runs through `simulate`, kept as that writes it).
The choice is the row with the best worst case (its mean final accuracy minus FedAvg's with the same
client optimizer, the smallest over the settings), among rows run on every setting with every seed at
no more than 1.3x FedAvg's local passes on any setting.

What differs from `python -m bench.field`'s headline runs: no broker, no cgroup quotas, no churn
(bench/inmemory.py's docstring says the rest), so 2 cores can run the matrix.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys

from . import provenance
from dataclasses import replace

from .algorithm_jobs import MOMENTUM, RESULTS, Job, Variant
from .algorithms import BASELINES, DEFAULT, ROUND_TIMEOUT, fleet_spec, run_job
from .field_settings_report import MAX_PASSES, choose, markdown, summarize
from .settings import DIGITS_LABEL_SKEW, HEADLINE, SYNTHETIC

SETTINGS = [HEADLINE, SYNTHETIC, DIGITS_LABEL_SKEW]
CHEAP = [SYNTHETIC, DIGITS_LABEL_SKEW]  # seconds a run: every row runs there
SEEDS = (1, 2, 3)
SERVERS = ("momentum", "adam", "yogi", "adagrad")
# `dynsam` with a leaky dual (feddyn.py's dual_decay), beta chosen on a validation split of the cheap
# settings (research/probe_dual.py --validation; docs/RESEARCH.md "The default across settings")
LEAKY = Variant("dynsam-leaky", "dynsam", (("dual_decay", 0.96),), "leaky dual, beta 0.96")
VARIANTS = {v.name: v for v in BASELINES + [DEFAULT, LEAKY]}
# Runs made with the host speed pinned (bench/host_speed.json) at today's engine; the runs in
# algorithms_runs/shipped_fold/ were each measured at its own process's calibrated speed, by older code.
PIPELINE = "pinned_speed"
PHASES = ("sgd", "server", "momentum", "fedavg-server")
SCREENED = ("server", "fedavg-server")  # the headline's seeds 2-3 only for rows that pass the screen
SCREEN_POINTS = 5.0  # a server row this far below its own row without it on seed 1 gets no more headline seeds


def job(setting: str, row: str, seed: int) -> Job:
    name, client, *server = row.split("+")
    return Job(setting, VARIANTS[name], MOMENTUM if client == "momentum" else 0.0, seed,
               server=server[0] if server else "", pipeline=PIPELINE)


def rows_of(phase: str, best: str) -> list[str]:
    if phase == "sgd":
        return [f"{name}+sgd" for name in VARIANTS]
    if phase == "momentum":
        return [f"{name}+momentum" for name in VARIANTS]
    if phase == "server":
        return [f"{best}+{server}" for server in SERVERS]
    return [f"fedavg+sgd+{server}" for server in SERVERS]


def plan(phase: str, best: str) -> list[Job]:
    """This phase's runs, seed by seed, the cheap settings' runs first; the cheap settings also run FedAvg
    with every server optimizer in the server phase (the headline's FedAvg rows come last, in their own).
    A server row runs the headline's seeds 2-3 only once its seed 1 passed `screened`."""
    rows = rows_of(phase, best)
    cheap = rows + (rows_of("fedavg-server", best) if phase == "server" else [])
    settings = [(s, cheap) for s in CHEAP] + [(HEADLINE, rows)]
    jobs = [job(setting, row, seed) for seed in SEEDS for setting, some in settings for row in some]
    if phase in SCREENED:
        jobs = [j for j in jobs if j.setting != HEADLINE or j.seed == SEEDS[0] or screened(j)]
    return jobs


def plan_rows(rows: list[str]) -> list[Job]:
    """Only these rows, on every setting and seed: seed by seed, the cheap settings first."""
    return [job(setting, row, seed) for seed in SEEDS for setting in CHEAP + [HEADLINE] for row in rows]


def screened(j: Job) -> bool:
    """Whether the headline row of `j` (a server optimizer's) earned more seeds: its seed 1 ended within
    SCREEN_POINTS of the same row without the server optimizer (2 cores cannot spend an hour on a row that
    is already far behind: dynsam with server momentum ended its first seed at 36.5%, against 96.2%)."""
    first = replace(j, seed=SEEDS[0])
    base = replace(j, seed=SEEDS[0], server="")
    if not (first.path.exists() and base.path.exists()):
        return False
    final = [json.loads(x.path.read_text())["accuracy"][-1] for x in (first, base)]
    return 100 * (final[1] - final[0]) <= SCREEN_POINTS


def cached(jobs: list[Job]) -> list[dict]:
    return [json.loads(j.path.read_text()) for j in jobs if j.path.exists()]


def every_cached_job() -> list[Job]:
    rows = rows_of("sgd", "") + rows_of("momentum", "") + [
        f"{row}+{server}" for row in rows_of("sgd", "") for server in SERVERS]
    return [job(setting, row, seed) for setting in SETTINGS for row in rows for seed in SEEDS]


def best_headline_row(records: list[dict]) -> str:
    """The best SGD row on the headline setting by mean final accuracy within the passes budget (the
    default's row until measured)."""
    table = summarize(records).get(HEADLINE, {})
    rows = {r: v for r, v in table.items() if r.endswith("+sgd") and len(v["final_accuracy"]) == len(SEEDS)
            and (v["passes_vs_fedavg"] or 0) <= MAX_PASSES}
    if not rows:
        return f"{DEFAULT.name}+sgd"
    return max(rows, key=lambda r: sum(rows[r]["final_accuracy"]) / len(rows[r]["final_accuracy"]))


def report() -> dict:
    records = cached(every_cached_job())
    table = summarize(records)
    choice = choose(table, SETTINGS, len(SEEDS))
    from broker_coordinator.settings.round_settings import RoundSettings
    shipped = RoundSettings()
    commits = sorted({r.get("commit", "unknown") for r in records})
    measured = provenance.measured_with(
        provenance.invoked(), {k: v for k, v in provenance.deciding(shipped).items()
                               if k not in ("algorithm", "momentum", "server_optimizer", "server_lr")},
        varies={"algorithm": "per row", "momentum": [0.0, MOMENTUM], "server_optimizer": ["sgd", *SERVERS]},
        data={s: s for s in SETTINGS}, seeds=list(SEEDS), round_timeout=ROUND_TIMEOUT,
        fleet={s: fleet_spec(20 if s != SYNTHETIC else 30) for s in SETTINGS}, transport="in process (bench/inmemory.py)",
        run_commits=commits, runs=f"cached in bench/results/algorithms_runs/{PIPELINE}/: a cached run may come from "
                                  "older code (run_commits)",
        host_speed="pinned: bench/host_speed.json (an emulated device's speed is it times its class's)",
        served=f"scores the served average of the global models (decay {shipped.serve_average:g}), which each run "
               "evaluates beside its last global model and never feeds back into training (bench/fedsim.py), so "
               "runs made while the coordinator served the last model measure it exactly")
    path = RESULTS / "field.json"
    field = json.loads(path.read_text()) if path.exists() else {}
    if "runs" in field:  # the file as bench/field.py wrote it alone: its runs become the "fleet" part
        field = {"fleet": field}
    default = {"algorithm": shipped.algorithm, "optimizer": "momentum" if shipped.momentum else "sgd",
               "server_optimizer": shipped.server_optimizer, "codec": shipped.codec,
               "local_epochs": shipped.local_epochs}
    field.update({"measured_with": measured, "default": default, "settings": table, "choice": choice})
    path.write_text(json.dumps(field, indent=1) + "\n")
    (RESULTS / "field_settings.md").write_text(markdown(table, choice, SETTINGS, measured))
    return choice


def run(jobs: list[Job], workers: int) -> None:
    todo = [j for j in jobs if not j.path.exists()]
    print(f"{len(jobs)} runs, {len(todo)} to do, {workers} worker(s)", flush=True)
    with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=4) as pool:
        for _ in pool.imap_unordered(run_job, todo):
            report()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, in order: {', '.join(PHASES)}")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (default 2: one per core here)")
    p.add_argument("--rows", default="", help="run only these rows (comma-separated ALGORITHM+CLIENT[+SERVER], "
                   f"ALGORITHM one of {', '.join(VARIANTS)}) on every setting, instead of the phases")
    p.add_argument("--report", action="store_true", help="only rebuild the report from the cached runs")
    args = p.parse_args(argv)
    if args.rows:
        rows = [r for r in args.rows.split(",") if r]
        unknown = [r for r in rows if r.split("+")[0] not in VARIANTS]
        if unknown:
            p.error(f"--rows: unknown algorithm in {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
        run(plan_rows(rows), args.workers)
        args.report = True
    phases = [x for x in args.phases.split(",") if x]
    wrong = set(phases) - set(PHASES)
    if wrong:
        p.error(f"--phases: unknown {', '.join(sorted(wrong))}; choose from {', '.join(PHASES)}")
    if not args.report:
        for phase in phases:
            best = best_headline_row(cached(every_cached_job()))
            print(f"phase {phase} (best headline row so far: {best})", flush=True)
            run(plan(phase, best), args.workers)
            if phase in SCREENED:  # seed 1 is in: the rows that passed the screen get seeds 2-3
                run(plan(phase, best), args.workers)
    choice = report()
    print((RESULTS / "field_settings.md").read_text())
    return 0 if choice.get("row") else 1


if __name__ == "__main__":
    sys.exit(main())
