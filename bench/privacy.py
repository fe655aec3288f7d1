"""Final accuracy against epsilon (user-level central DP, docs/PRIVACY.md): `make privacy`.

Two cohorts through the shipped engine, with real local training:

- `1000of10000`, with the in-memory transport (bench/inmemory.py: the coordinator's own intake,
  private fold, accountant and budget stop): FedProx Synthetic(1, 1) with 10,000 devices, 1,000 expected per round (Poisson
  sampling, q = 0.1), the 83,978-parameter `synthetic_mlp` on its 60 features, FedProx. Every
  device labels with one shared model (`--synthetic-labels shared`, the default: the devices'
  inputs still shift per device): with its own labelling model per device, as in FedProx's
  Synthetic, no global model learns 10,000 of them (trained on the pooled data of 400 devices it
  stays at chance, 12%, on held-out devices), and DP would look free because nothing learns;
- `10of20`: the headline MNIST partition (bench/data, 20 devices), 10 per round (q = 0.5),
  the 80,202-parameter `mnist_cnn`, FedAvg, through `broker-coordinator simulate` (a real Mosquitto
  and 20 agent processes, `[rounds]` and `[privacy]` from a config file: bench/privacy_simulate.py).

For each epsilon in {1, 3, 8} at delta 1e-5 the noise multiplier is computed for the rounds run
(planned_rounds = rounds), with adaptive clipping; "none" is the same fold without privacy
(`aggregator = "mean"`, `weighting = "uniform"`, `norm_bound = 0`), so only DP differs. Writes
bench/results/privacy.json (schema of issue 21) and privacy.md.

Sized to the machine with flags (the defaults are the issue's: 40 rounds, 3 seeds, no caps); the
results say what was cut: --rounds, --seeds, --synthetic-rounds, --synthetic-seeds, --cap (training
samples per synthetic device), --test (synthetic test samples).

Every (cohort, epsilon, seed) run is cached in bench/results/privacy_runs/<cohort>-<sizing>/ and
never repeated; a process claims a run before it starts it, so two processes with the same flags
share the work (one per core), and the one that finds every run done writes the result:

    nice python -m bench.privacy --only 1000of10000 --cap 50 --test 3000 &   # twice: one per core
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import inmemory, provenance
from bench.privacy_simulate import simulate_run
from broker_coordinator.aggregation.accountant import Accountant, Sampling
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_settings import RoundSettings
from models import datasets

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "privacy_runs"
EPSILONS = ("1", "3", "8", "none")
DELTA = 1e-5


def synthetic(cap: int, test_size: int, shared: bool = True) -> tuple[list[datasets.Dataset], datasets.Dataset]:
    data = datasets.load_synthetic(1.0, 1.0, num_users=10_000, seed=0, shared_model=shared)
    clients = [data.train.subset(s[:cap] if cap else s) for s in data.natural_shards]
    rng = np.random.default_rng(1)
    test = data.test.subset(rng.permutation(len(data.test))[:test_size]) if test_size else data.test
    return clients, test


def settings_for(algorithm: str, epsilon: str, cohort: int, population: int, rounds: int,
                 clip_initial: float, lr: float) -> RoundSettings:
    privacy = PrivacySettings() if epsilon == "none" else PrivacySettings(
        mode="central", target_epsilon=float(epsilon), delta=DELTA, planned_rounds=rounds, population=population,
        clip="adaptive", clip_initial=clip_initial)
    return RoundSettings(algorithm=algorithm, clients_per_round=cohort, local_epochs=1, lr=lr, aggregator="mean",
                         weighting="uniform", norm_bound=0, round_timeout=60, privacy=privacy)


def run(name: str, arch: str, clients: list, test, settings: RoundSettings, rounds: int, seed: int) -> dict:
    settings.validate()
    fed = inmemory.InMemoryFederation(arch, clients, test, settings, seed, settings.clients_per_round)
    seconds: list[float] = []
    real = inmemory.fold_round

    def timed(*args, **kwargs):  # the coordinator's whole round: intake, fold, noise, accountant, evaluation
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    inmemory.fold_round = timed
    trace, accuracy = [], []
    try:
        for round_no in range(1, rounds + 1):
            record = fed.round(round_no)
            if record is None:
                continue
            accuracy.append(record.accuracy)
            p = record.privacy
            trace.append({"round": round_no, "accuracy": record.accuracy, "participants": record.participants,
                          "seconds": seconds[-1], "bytes_up": record.bytes_up,
                          **{k: p[k] for k in ("epsilon", "clip", "noise_std", "unclipped_fraction") if k in p}})
    finally:
        inmemory.fold_round = real
    private = fed.coordinator.privacy
    print(f"{name} seed {seed}: {100 * accuracy[-1]:.2f}% after {rounds} rounds"
          + (f", epsilon {private.spent:.3f} (z {private.z:.3f})" if private else ""), flush=True)
    return {"final_accuracy": accuracy[-1], "epsilon_spent": private.spent if private else None,
            "noise_multiplier": private.z if private else None, "trace": trace}


def accountant_check(rounds: int) -> dict:
    """Ours (dp-accounting PLD) against Microsoft's prv-accountant, 1,000 of 10,000, z = 0.83."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant
    ours = Accountant("pld").epsilon([(Sampling("poisson", 10_000, 1_000), 0.83, rounds)], DELTA)
    prv = PRVAccountant(prvs=PoissonSubsampledGaussianMechanism(noise_multiplier=0.83, sampling_probability=0.1),
                        max_self_compositions=rounds, eps_error=0.01, delta_error=1e-10)
    second = prv.compute_epsilon(delta=DELTA, num_self_compositions=[rounds])[1]
    rdp = Accountant("rdp").epsilon([(Sampling("poisson", 10_000, 1_000), 0.83, rounds)], DELTA)
    return {"ours": ours, "second": float(second), "ours_accountant": "dp-accounting PLD",
            "second_accountant": "prv-accountant PRVAccountant", "rdp": rdp, "q": 0.1, "z": 0.83, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="10of20 rounds")
    ap.add_argument("--seeds", type=int, default=3, help="10of20 seeds")
    ap.add_argument("--synthetic-rounds", type=int, default=40)
    ap.add_argument("--synthetic-seeds", type=int, default=3)
    ap.add_argument("--cap", type=int, default=0, help="training samples per synthetic device (0 = all)")
    ap.add_argument("--test", type=int, default=0, help="synthetic test samples (0 = all)")
    ap.add_argument("--clip-initial", type=float, default=0.5)
    ap.add_argument("--only", choices=("1000of10000", "10of20"), default=None)
    ap.add_argument("--synthetic-labels", choices=("shared", "per-device"), default="shared",
                    help="one labelling model for every synthetic device (learnable), or FedProx's own per device")
    ap.add_argument("--merge", type=Path, default=None,
                    help="with --only: keep the other cohort's rows from this earlier result file")
    ap.add_argument("--combine", type=Path, nargs=2, metavar=("MAIN", "OTHER"), default=None,
                    help="no run: MAIN's result with OTHER's rows of the cohorts MAIN lacks (each run's "
                         "measured_with kept) into --out")
    ap.add_argument("--out", type=Path, default=RESULTS / "privacy.json")
    args = ap.parse_args(argv)
    if args.combine:
        return combine(*args.combine, args.out)
    inmemory.set_threads(1)
    started = time.time()
    runs: dict[str, dict] = {}
    cuts = []
    merged = None
    if args.merge:
        if not args.only:
            ap.error("--merge keeps the other cohort of an earlier run: give --only the cohort to run now")
        merged = json.loads(args.merge.read_text())
        runs = {k: v for k, v in merged["runs"].items() if k != args.only}
    if args.only != "10of20":
        clients, test = synthetic(args.cap, args.test, args.synthetic_labels == "shared")
        sizing = f"r{args.synthetic_rounds}-cap{args.cap}-test{args.test}-{args.synthetic_labels}-clip{args.clip_initial:g}"
        done = cached_runs(RUNS / f"1000of10000-{sizing}", args.synthetic_seeds, lambda eps, seed: run(
            f"1000of10000 eps {eps}", "synthetic_mlp", clients, test,
            settings_for("fedprox", eps, 1000, 10_000, args.synthetic_rounds, args.clip_initial, 0.05),
            args.synthetic_rounds, seed))
        if done is None:
            return 0  # another process runs the rest and writes the result
        runs["1000of10000"] = done
        partial(args.out, runs)
    if args.only != "1000of10000":
        done = cached_runs(RUNS / f"10of20-simulate-r{args.rounds}-clip{args.clip_initial:g}", args.seeds,
                           lambda eps, seed: simulate_run(eps, seed, args.rounds, args.clip_initial, DELTA))
        if done is None:
            return 0
        runs["10of20"] = done
        partial(args.out, runs)
    for flag, value, full in (("rounds", args.rounds, 40), ("seeds", args.seeds, 3),
                              ("synthetic_rounds", args.synthetic_rounds, 40),
                              ("synthetic_seeds", args.synthetic_seeds, 3)):
        if value != full:
            cuts.append(f"{flag} {value} (issue: {full})")
    if args.cap:
        cuts.append(f"synthetic devices train on at most {args.cap} samples each (issue: all)")
    if args.test:
        cuts.append(f"synthetic test set subsampled to {args.test}")
    big = runs.get("1000of10000", {})
    round_seconds = {"off": big["none"]["round_seconds"], "central": big["8"]["round_seconds"]} if big else {}
    result = {
        "measured_with": provenance.measured_with(provenance.invoked(), provenance.deciding(
            settings_for("fedprox", "8", 1000, 10_000, args.synthetic_rounds, args.clip_initial, 0.05)),
            delta=DELTA, sampling="poisson", clip="adaptive", clip_initial=args.clip_initial, local_epochs=1,
            transport={"1000of10000": "in-memory (bench/inmemory.py)",
                       "10of20": "broker-coordinator simulate (bench/privacy_simulate.py)"}, cuts=cuts, wall_seconds=round(time.time() - started),
            synthetic_labels=args.synthetic_labels,
            **({"merged": {k: merged["measured_with"] for k in runs if k != args.only}} if merged else {})),
        "runs": runs,
        "accountant_check": accountant_check(args.synthetic_rounds),
        "round_seconds": round_seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(report(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def combine(main: Path, other: Path, out: Path) -> int:
    """Two partial results as one: MAIN's, plus OTHER's rows of the cohorts MAIN did not run."""
    result, extra = json.loads(main.read_text()), json.loads(other.read_text())
    added = [k for k in extra["runs"] if k not in result["runs"]]
    result["runs"].update({k: extra["runs"][k] for k in added})
    result["measured_with"] = {**result["measured_with"],
                               "merged": {k: extra["measured_with"] for k in added}}
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report(result))
    print(f"wrote {out} and {out.with_suffix('.md')}: {', '.join(added) or 'nothing'} from {other}")
    return 0


def cached_runs(folder: Path, seeds: int, one_run: Callable[[str, int], dict]) -> dict | None:
    """Each epsilon's summary over `seeds` seeds, every run cached in `folder`; None when runs that
    another process claimed are still going (that process, finishing last, gets the whole set)."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(eps, seed) for seed in range(seeds) for eps in EPSILONS]  # seed 0 of every epsilon first
    for eps, seed in jobs:
        path = folder / f"eps{eps}-seed{seed}.json"
        claim = path.with_suffix(".claim")
        if path.exists():
            continue
        if not take_claim(claim):
            continue  # another live process runs it
        try:
            result = one_run(eps, seed)
            result["measured_with"] = {"commit": provenance.commit(), "command": provenance.invoked()}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(path)
        finally:
            claim.unlink(missing_ok=True)
    if any(not (folder / f"eps{eps}-seed{seed}.json").exists() for eps, seed in jobs):
        print(f"runs still going in {folder}; the process that finishes last writes the result", flush=True)
        return None
    return {eps: summarize([json.loads((folder / f"eps{eps}-seed{seed}.json").read_text()) for seed in range(seeds)])
            for eps in EPSILONS}


def take_claim(claim: Path) -> bool:
    """Create `claim` holding our pid; a claim whose process has died is taken over."""
    for _ in range(2):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(claim.read_text() or 0), 0)
                return False
            except (ProcessLookupError, ValueError, FileNotFoundError):
                claim.unlink(missing_ok=True)  # its process is gone (killed mid-run)
                continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def partial(out: Path, runs: dict) -> None:
    """The rows so far, beside the result (not in bench/results' schema: no measured_with yet)."""
    out.with_suffix(".partial").write_text(json.dumps(runs))


def summarize(per_seed: list[dict]) -> dict:
    seconds = [t["seconds"] for r in per_seed for t in r["trace"]]
    return {"final_accuracy": [r["final_accuracy"] for r in per_seed],
            "epsilon_spent": per_seed[0]["epsilon_spent"], "noise_multiplier": per_seed[0]["noise_multiplier"],
            "round_seconds": statistics.median(seconds) if seconds else None,
            "trace": per_seed[0]["trace"]}


def report(result: dict) -> str:
    m = result["measured_with"]
    lines = ["# Accuracy against epsilon (user-level central DP)", "",
             f"`{m['command']}` on commit {m['commit']}, {m['wall_seconds']} s; delta {m['delta']:g}, Poisson "
             "sampling, adaptive clipping; 1000of10000 through the in-memory engine (bench/inmemory.py), 10of20 "
             "through `broker-coordinator simulate` (bench/privacy_simulate.py). "
             + (f"Cut to fit the machine: {'; '.join(m['cuts'])}." if m["cuts"] else ""), "",
             "| cohort | epsilon | z | epsilon spent | final accuracy (per seed) | mean |",
             "| --- | --- | --- | --- | --- | --- |"]
    for cohort, rows in result["runs"].items():
        for eps, row in rows.items():
            acc = row["final_accuracy"]
            z = f"{row['noise_multiplier']:.3f}" if row["noise_multiplier"] else "-"
            spent = f"{row['epsilon_spent']:.3f}" if row["epsilon_spent"] is not None else "-"
            lines.append(f"| {cohort} | {eps} | {z} | {spent} | {', '.join(f'{100 * a:.2f}' for a in acc)} | "
                         f"{100 * statistics.mean(acc):.2f} |")
    check = result["accountant_check"]
    lines += ["", f"Accountant check (q {check['q']}, z {check['z']}, {check['rounds']} rounds): ours "
              f"({check['ours_accountant']}) {check['ours']:.4f}, second ({check['second_accountant']}) "
              f"{check['second']:.4f}, {100 * abs(check['ours'] / check['second'] - 1):.3f}% apart; RDP "
              f"{check['rdp']:.4f}."]
    if result["round_seconds"]:
        rs = result["round_seconds"]
        lines.append(f"Coordinator time per round at 1,000 participants (median): off {rs['off']:.3f} s, central "
                     f"{rs['central']:.3f} s ({rs['central'] / rs['off']:.3f}x).")
    if "10of20" in result["runs"]:
        lines.append("The 10-of-20 rows give no useful privacy: with q = 0.5 and 10 devices per round, the noise "
                     "a meaningful epsilon needs is larger than the clipped updates it hides.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
