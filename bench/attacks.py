"""Attack benchmark (a benchmark, not a test): a fraction of enrolled devices send signed,
well-formed, malicious updates, against what ships, flat and in sites.

    python -m bench.attacks --jobs 2     # the grid (about an hour on 2 cores, 20 minutes a full fold)
    python -m bench.attacks --quick      # a smoke run: one partition, 3 rounds, 3 runs, one seed
    python -m bench.attacks --report     # rebuild attacks.json / attacks.md / attacks.png from cached runs

Every device runs the agent's own round through `bench/inmemory.py`: the shipped default
algorithm (`dynsam`), device-chosen epochs (planned from its emulated class speed and the
deadline, on the demo's fleet mix with its 6 s round timeout, as `bench/algorithms.py`), the
default codec with its error feedback, its own signing key. The signed payloads go through the
coordinator's own intake, trust bounds, fold, server rule and evaluation (`fold_round`); in sites
through four `SiteWorker`s and the tree's combination of their partials (`fold_partials`). Only
the broker is left out. Every coordinator setting is the default except the fold (`FOLDS`, the
rows) and `clients_per_round = 10`.

Attackers are a seeded sample of the devices (`attackers_of`); each round's cohort is drawn as
the coordinator draws it, so a round holds none to several. On top of an attacker's honestly
trained delta d (the attacker knows the coordinator's state: a white-box adversary):
- sign_flip: -3 d
- reversed: the last applied global step reversed, scaled to just under the norm bound
  (the largest length the coordinator accepts)
- colluding: every attacker of a round sends the same crafted update (-3 x the first one's d)
- label_flip: trained on y -> 9 - y
- backdoor: trained with half its data stamped with a 3x3 white patch (MNIST; the last 3 features
  at 3x the data's largest value for vectors) and labelled 0; `attack_success` is the share of
  stamped test examples of classes 1-9 the final model labels 0
- inflated_count: -d, claiming 2^62 samples
- adaptive: knows the fold's rule and stays just inside it: the reversed last step at 0.95 x
  centered_clip's radius from the centre (0.95 x the norm bound for `mean`); against centered_clip
  turned to keep a cosine of 0.3 with its own honest delta, so that its consensus stage sees it agree
- compromised_site (in sites): one site aggregator of 4 sends a forged, correctly signed partial
  (its mean step -10x, its weight 100x, claiming all of its site's devices)
And `clean` (no attackers) and `absent` (the attackers' devices and data not in the federation,
the best any defence can reach under non-IID data).

SIZE: 10 rounds (30 on the second partition); MNIST-5k Dirichlet(0.5) over 20 devices (the MLP of `edgefl_models.architectures`) and
FedProx's Synthetic(1,1) over 30 (logistic regression); 2 seeds; on the second partition only
clean, absent and the 10% attacks that move the model most (`SECOND_ATTACKS`); `mean` runs only
`BASELINE_RUNS`, the folds that hold the round (`HELD_FOLDS`) only `HELD_RUNS` on the headline.
Runs are cached per (partition, run, fold, seed) in bench/results/attacks_runs/ (resumable).

Each run records, besides its accuracy per round, what the fold did to honest devices: the share of
their updates folded below full weight (`honest_down_weighted`) and the least weight one kept
(`honest_min_weight`, 0 if one was left out); the report adds each attacked run's `early_gap`, the
largest clean-minus-attacked served accuracy over rounds 2-5. The `centered_clip+root` row gives the
coordinator ROOT_SAMPLES clean examples (`root_set`) and turns on `[fold] root_trust`.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import sys
import time
import zlib

import numpy as np

from .attacks_report import (  # the grid's names, which the report reads too
    FOLDS,
    GRID,
    HEADLINE,
    RESULTS,
    ROOT_SAMPLES,
    ROUND_TIMEOUT,
    RUNS,
    SECOND,
    SECOND_ATTACKS,
    SITES,
    report,
    run_key,
)

ATTACKS = ("sign_flip", "reversed", "colluding", "label_flip", "backdoor", "inflated_count", "adaptive")
FRACTIONS = (0.1, 0.2)
BASELINE_RUNS = ("clean", "absent@0.1", "absent@0.2", "sign_flip@0.1", "reversed@0.2", "backdoor@0.1",
                 "backdoor@0.2", "sites/clean", "sites/compromised_site@0.25")
# the folds that hold the round (flat only), on the runs that moved centered_clip most before its consensus stage
HELD_FOLDS = ("geomed", "trimmed_mean", "median")
FULL_FOLDS = ("centered_clip", "centered_clip+votes", "centered_clip+votes+serve0.75", "centered_clip+kinship0.4",
              "centered_clip+banks8", "centered_clip+banks8+kinship0.4", "centered_clip+floor0.05",
              "centered_clip+serve0", "centered_clip+serve0.9", "centered_clip+root",
              "centered_clip+flags2")  # every run; the other folds only BASELINE_RUNS
HELD_RUNS = ("clean", "absent@0.2", "sign_flip@0.2", "label_flip@0.2", "colluding@0.2", "inflated_count@0.2",
             "backdoor@0.1")
ROUNDS = 10
SECOND_ROUNDS = 30  # logistic regression is cheap, and after 10 rounds its accuracy is mostly seed noise
ARCH = {HEADLINE: "mnist_mlp"}  # the CNN of bench/algorithms.py costs 1.5x: the grid would not fit an hour
SEEDS = (1, 2)
BACKDOOR_CLASS = 0
DISGUISE = 0.3  # adaptive: its cosine with its own honest delta (honest ones' median cosine is 0.02-0.4)


def attackers_of(fraction: float, devices: list[str], seed: int) -> set[str]:
    return set(random.Random(f"attackers/{seed}").sample(devices, round(fraction * len(devices))))


def stamp(x: np.ndarray) -> np.ndarray:
    """The backdoor's trigger: a 3x3 white patch in the corner (images), the last 3 features (vectors)."""
    x = x.copy()
    if x.ndim == 4:
        x[:, :, -4:-1, -4:-1] = x.max()
    else:
        x[:, -3:] = 3 * np.abs(x).max()
    return x


def _unit(tensors: dict) -> tuple[dict, float]:
    norm = float(np.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in tensors.values())))
    return {n: a / max(norm, 1e-12) for n, a in tensors.items()}, norm


def _disguised(step_unit: dict, own: dict) -> dict:
    """The direction -u (u: the returned unit vector) that reverses the last step as far as it can while
    keeping a cosine of DISGUISE with the attacker's own honestly trained delta, its best guess of
    the round's majority: so centered_clip's consensus stage (median cosine with the round's other
    updates) sees an agreeing update."""
    mine, _ = _unit(own)
    dot = sum(float(np.sum(step_unit[n] * mine[n])) for n in own)
    away, _ = _unit({n: -step_unit[n] + dot * mine[n] for n in own})  # -step, orthogonal to its own delta
    return {n: -(DISGUISE * mine[n] + np.sqrt(1 - DISGUISE ** 2) * away[n]) for n in own}


class Attack:
    """One run's attackers: what they train on (`data_of`) and what they send (`tamper`)."""

    def __init__(self, name: str, bad: set[str], seed: int) -> None:
        self.name, self.bad, self.seed = name, bad, seed
        self.coordinator = None  # set once the federation exists (the white-box attacker reads it)
        self.shared: dict[int, dict] = {}  # colluding: round -> the one crafted update
        self.sent = 0  # attackers' updates sent

    def data_of(self, device: str, data):
        from edgefl_models.datasets import Dataset
        if device not in self.bad or self.name not in ("label_flip", "backdoor"):
            return data
        if self.name == "label_flip":
            return Dataset(data.x, 9 - data.y)
        rng = np.random.default_rng(zlib.crc32(f"backdoor/{device}/{self.seed}".encode()))  # hash() varies by process
        half = rng.permutation(len(data))[: len(data) // 2]
        x, y = data.x.copy(), data.y.copy()
        x[half], y[half] = stamp(x[half]), BACKDOOR_CLASS
        return Dataset(x, y)

    def tamper(self, device: str, delta: dict, num_samples: int, round_no: int) -> tuple[dict, int]:
        if device not in self.bad:
            return delta, num_samples
        self.sent += 1
        c = self.coordinator
        if self.name == "sign_flip":
            return {n: -3.0 * a for n, a in delta.items()}, num_samples
        if self.name == "inflated_count":
            return {n: -a for n, a in delta.items()}, 2**62
        if self.name == "colluding":
            crafted = self.shared.setdefault(round_no, {n: -3.0 * a for n, a in delta.items()})
            return {n: a.copy() for n, a in crafted.items()}, num_samples
        if self.name in ("reversed", "adaptive"):
            step = c.center if c.center is not None else delta  # the last applied step (or its own delta)
            u, _ = _unit(step)
            bound = c.norm_bound.bound() or _unit(delta)[1]
            if self.name == "reversed":
                return {n: -0.99 * bound * u[n] for n in delta}, num_samples
            tau = c.radius.bound() if c.center is not None and c.settings.aggregator == "centered_clip" else None
            if c.settings.aggregator == "centered_clip":  # keep a positive cosine with the round's majority
                u = _disguised(u, delta)
            x = ({n: c.center[n] - 0.95 * tau * u[n] for n in delta} if tau is not None
                 else {n: -0.95 * bound * u[n] for n in delta})
            unit_x, norm_x = _unit(x)
            if norm_x > 0.95 * bound:  # inside the norm bound too
                x = {n: 0.95 * bound * unit_x[n] for n in delta}
            return {n: np.asarray(a, np.float32) for n, a in x.items()}, num_samples
        return delta, num_samples


def run_one(partition: str, run: str, fold: str, seed: int, rounds: int) -> dict:
    import torch

    from bench import settings as bench_settings
    from bench.algorithms import fleet_for
    from bench.inmemory import InMemoryFederation
    from broker_coordinator.settings.round_settings import RoundSettings

    torch.set_num_threads(1)
    logging.getLogger("broker_coordinator").setLevel(os.environ.get("EDGEFL_BENCH_LOG", "ERROR"))
    fed = {HEADLINE: bench_settings.dirichlet05, SECOND: bench_settings.synthetic}[partition]()
    fed.arch = ARCH.get(partition, fed.arch)
    rs = RoundSettings(clients_per_round=fed.clients_per_round, round_timeout=ROUND_TIMEOUT, **FOLDS[fold])
    devices = [f"dev-{i:03d}" for i in range(len(fed.clients))]
    fleet = fleet_for(len(fed.clients), seed)
    sites = run.startswith("sites/")
    attack, _, frac = run.removeprefix("sites/").partition("@")
    bad = attackers_of(float(frac), devices, seed) if frac and attack != "compromised_site" else set()
    keep = [i for i, d in enumerate(devices) if not (attack == "absent" and d in bad)]
    plan = Attack(attack, bad, seed)
    root = root_set([fed.clients[i] for i, d in enumerate(devices) if d not in bad], seed) if rs.root_trust else None
    sim = InMemoryFederation(fed.arch, [fed.clients[i] for i in keep], fed.test, rs, seed, fed.clients_per_round,
                             fleet=[fleet[i] for i in keep], data_of=plan.data_of, tamper=plan.tamper, root=root)
    if attack == "absent":  # the remaining devices keep their names, so attackers_of means the same devices
        sim.devices = [devices[i] for i in keep]
        sim.data = dict(zip(sim.devices, sim.data.values()))
        sim.keys = {d: k for d, k in zip(sim.devices, sim.keys.values())}
        sim.classes = dict(zip(sim.devices, sim.classes.values()))
        sim.states = {d: {} for d in sim.devices}
        sim.coordinator.intake.keys = dict(sim.keys)
    in_sites = None
    if sites:
        from bench.attacks_sites import InSites
        in_sites = InSites(sim, SITES, compromised=attack == "compromised_site")
    plan.coordinator = sim.coordinator
    started = time.time()
    accuracy, sent, folded, honest, left_out, clipped = [], 0, 0, 0, 0, {}
    down_weighted, least_weight = 0, 1.0  # honest updates folded below their full weight, and the least kept
    for round_no in range(1, rounds + 1):
        record = in_sites.round(round_no) if in_sites else sim.round(round_no)
        if record is None:
            accuracy.append(accuracy[-1] if accuracy else 0.0)
            continue
        accuracy.append(record.accuracy)
        for kind, n in record.clipped.items():
            clipped[kind] = clipped.get(kind, 0) + n
        for device, metrics in record.devices.items():
            if "/" in device or device.startswith("site "):  # a site's rows in a tree's record
                continue
            kept = "left_out" not in metrics
            if device in bad:
                folded += kept
            else:
                honest, left_out = honest + 1, left_out + (not kept)
                share = weight_share(metrics) if kept else 0.0
                down_weighted += share < 1
                least_weight = min(least_weight, share)
    sent = plan.sent
    out = {"partition": partition, "run": run, "fold": fold, "seed": seed, "rounds": rounds,
           "accuracy": accuracy, "final_accuracy": accuracy[-1], "attackers": sorted(bad),
           "attacker_updates_sent": sent, "attacker_updates_folded": folded, "honest_updates": honest,
           "honest_left_out": left_out, "honest_down_weighted": down_weighted / max(1, honest),
           "honest_min_weight": least_weight, "clipped": clipped, "rejected": dict(sim.coordinator.intake.rejections),
           "seconds": round(time.time() - started, 1)}
    if in_sites is not None:
        out["forged_partials"] = in_sites.forged
    if attack == "backdoor":
        out["attack_success"] = attack_success(sim)
    return out


def root_set(honest: list, seed: int):
    """root_trust's clean set: ROOT_SAMPLES examples drawn from the honest devices' pooled data (FLTrust's
    setting: the operator holds a small sample of the task's data; the devices keep theirs)."""
    from edgefl_models.datasets import Dataset
    x, y = np.concatenate([d.x for d in honest]), np.concatenate([d.y for d in honest])
    pick = np.random.default_rng(zlib.crc32(f"root/{seed}".encode())).choice(len(y), ROOT_SAMPLES, replace=False)
    return Dataset(x[pick], y[pick])


def weight_share(metrics: dict) -> float:
    """The share of its weight a folded update kept: its standing (`weight_share`, "0.60 (why)") times the
    scale its round's flags gave its partial sum (`held_back`); 1 when neither."""
    share = float(str(metrics.get("weight_share", "1")).split()[0])
    return share * float(metrics.get("held_back", 1.0))


def attack_success(sim) -> float:
    """Share of stamped test examples of classes 1-9 the final (served) model labels BACKDOOR_CLASS."""
    import torch

    test = sim.test
    mask = test.y != BACKDOOR_CLASS
    x = torch.from_numpy(stamp(test.x[mask]))
    model = sim.coordinator.served_model
    model.eval()
    with torch.no_grad():
        predicted = torch.cat([model(x[i:i + 256]).argmax(1) for i in range(0, len(x), 256)])
    return float((predicted == BACKDOOR_CLASS).float().mean())


def runs_of(partition: str, fold: str = "centered_clip") -> list[str]:
    """The runs of a partition for a fold (the default fold runs them all; baselines `BASELINE_RUNS`)."""
    if partition == SECOND:
        out = ["clean", "absent@0.1", *[f"{a}@0.1" for a in SECOND_ATTACKS]]
    else:
        out = ["clean", *[f"absent@{f:g}" for f in FRACTIONS]]
        out += [f"{a}@{f:g}" for f in FRACTIONS for a in ATTACKS]
        out += ["sites/clean", "sites/compromised_site@0.25"]
    if fold in HELD_FOLDS:
        return [r for r in out if r in HELD_RUNS] if partition == HEADLINE else []
    return out if fold in FULL_FOLDS else [r for r in out if r in BASELINE_RUNS]


def run_measured_with(result: dict) -> dict:
    """A cached run's `measured_with`: the commit and command it records, and the settings that
    decide it (what `run_one` builds for its partition, run and fold)."""
    from bench import provenance
    from broker_coordinator.settings.round_settings import RoundSettings
    settings = RoundSettings(clients_per_round=10, round_timeout=ROUND_TIMEOUT, **FOLDS[result["fold"]])
    topology = "sites" if result["run"].startswith("sites/") else "flat"
    return {"commit": result["commit"], "command": result["command"], **provenance.deciding(settings, topology),
            "sign_quorum": settings.sign_quorum, "root_trust": settings.root_trust,
            **({"root_data": f"{ROOT_SAMPLES} examples of the honest devices' pooled data"} if settings.root_trust else {}),
            "partition": result["partition"], "run": result["run"], "fold": result["fold"], "seed": result["seed"],
            "rounds": result["rounds"], "arch": ARCH.get(result["partition"], "partition's own"),
            "clients_per_round": 10, "round_timeout": ROUND_TIMEOUT, "transport": "in-memory (bench/inmemory.py)",
            "rerun": "python -m bench.attacks (resumes from the cached runs)"}


def stamp_cached() -> int:
    """Give the cached runs written before runs carried a `measured_with` theirs (from what they record)."""
    stamped = 0
    for path in sorted(RUNS.glob("*.json")):
        result = json.loads(path.read_text())
        if "measured_with" not in result and "commit" in result:
            result["measured_with"] = run_measured_with(result)
            path.write_text(json.dumps(result))
            stamped += 1
    return stamped


def _job(args: tuple) -> str:
    path = RUNS / f"{run_key(*args)}.json"
    if path.exists():
        return f"cached {path.name}"
    from bench import provenance
    result = run_one(*args)
    result["commit"], result["command"] = provenance.commit(), provenance.invoked()
    result["measured_with"] = run_measured_with(result)
    RUNS.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return f"{path.name}: final {100 * result['final_accuracy']:.2f}% in {result['seconds']:.0f} s"


def plan(rounds: int, folds: list[str], seeds: tuple[int, ...], partitions: list[str]) -> list[tuple]:
    """Jobs, the default fold first and seed 1 first, so a partial grid answers the issue soonest."""
    return [(partition, run, fold, seed, SECOND_ROUNDS if partition == SECOND else rounds)
            for fold in sorted(folds, key=lambda f: f != "centered_clip")
            for seed in seeds for partition in partitions for run in runs_of(partition, fold)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attacks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (one torch thread each)")
    parser.add_argument("--folds", default=",".join(GRID),
                        help=f"comma-separated folds (rows) of: {', '.join(FOLDS)} (default: the grid)")
    parser.add_argument("--quick", action="store_true", help="3 rounds, 3 runs, seed 1: a smoke run")
    parser.add_argument("--report", action="store_true", help="only rebuild the files from cached runs")
    args = parser.parse_args(argv)
    folds = args.folds.split(",")
    if set(folds) - set(FOLDS):
        parser.error(f"unknown folds: {', '.join(sorted(set(folds) - set(FOLDS)))}; known: {', '.join(FOLDS)}")
    if args.quick:
        jobs = [(HEADLINE, run, "centered_clip", 1, 3) for run in ("clean", "backdoor@0.2", "sites/compromised_site@0.25")]
        for line in map(_job, jobs):
            print(line, flush=True)
        return 0
    jobs = plan(args.rounds, folds, SEEDS, [HEADLINE, SECOND])
    if not args.report:
        if args.jobs > 1:
            with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
                for line in pool.imap_unordered(_job, jobs):
                    print(line, flush=True)
        else:
            for job in jobs:
                print(_job(job), flush=True)
    if stamped := stamp_cached():
        print(f"{stamped} cached runs given their measured_with", flush=True)
    report(jobs, folds)
    print((RESULTS / "attacks.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
