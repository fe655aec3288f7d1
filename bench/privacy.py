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

`round_seconds` (the target: the coordinator's time per round at 1,000 participants with DP at most
1.05x without) is measured on its own, interleaved (`round_time`): 1,000 synthetic devices train
once, and their signed updates (the shipped codec, re-signed for each round's number and model
version) are folded again and again by two coordinators of the shipped engine, one without privacy
(the "none" fold above) and one with `[privacy] mode = "central"` at epsilon 8, adaptive clip, in
the order off, central, central, off, off, central, ... so that whatever else the machine does
lands on both alike. Each timed round is what the coordinator does per round: its cohort draw
(`select`; private: the budget check and the CSPRNG's Poisson draw of 10,000 devices, its cohort
then discarded so that both fold the same 1,000 updates) and `fold_round` (intake, signature,
decode, fold, noise, accountant, server rule, evaluation on the test set, record). It reports the
medians of wall seconds and of the thread's CPU seconds, their ratios, and the median of the
per-pair ratios. A full run measures it after the accuracy runs (the per-run medians of those
rounds stay in each row's `round_seconds`, not comparable: they ran at different times);
`--round-time-only` measures only it and writes it into the existing --out file, every other
field kept (--round-repeats: timed rounds per coordinator, after one untimed warm-up each).

Every (cohort, epsilon, seed) run is cached in bench/results/privacy_runs/<cohort>-<sizing>/ and
never repeated; a process claims a run before it starts it, so two processes with the same flags
share the work (one per core), and the one that finds every run done writes the result:

    nice python -m bench.privacy --only 1000of10000 --cap 50 --test 3000 &   # twice: one per core
"""

from __future__ import annotations

import argparse
import dataclasses
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
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.selection import select
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.in_memory import fold_round
from edgefl_protocol import codec, messages
from edgefl_models import datasets

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


# The synthetic devices' learning rate. Each trains one epoch of its 50 samples (2 steps at batch 32),
# so a round moves the model about as far as 2 steps of gradient descent on the pooled data. At 0.05,
# 40 rounds stayed at 50.8% (seed 0, 2026-11): trained on the pooled data of 1,000 devices by full-batch
# descent the MLP is at 52.6% after 12 steps at 0.5 and at 79.0% after 80 (90.3% after 400), and at
# 0.05 it needs ten times the steps; at 1.0 it diverges. At 0.5 the federation ended at 52.9% without
# privacy (2026-12-02): it learns, but far more slowly than descent on the pooled data. A probe with one
# full-batch local step a round (batch 50) reached 68% by round 25: the two local steps hold it back
# (docs/PRIVACY.md), so the devices now train in batches of SYNTHETIC_BATCH: one step of their 50 samples.
SYNTHETIC_LR = 0.5
SYNTHETIC_BATCH = 50


def settings_for(algorithm: str, epsilon: str, cohort: int, population: int, rounds: int,
                 clip_initial: float, lr: float, batch_size: int = 32, serve_average: float = 0.0,
                 server: dict | None = None, target_quantile: float = 0.5,
                 uplink: str = codec.DEFAULT, accountant: str = "rdp") -> RoundSettings:
    """`server`: [rounds] server_optimizer keys (server_optimizer, server_lr, server_momentum); the
    optimizer steps on the private fold's output, so it is post-processing and costs no epsilon."""
    privacy = PrivacySettings() if epsilon == "none" else PrivacySettings(
        mode="central", target_epsilon=float(epsilon), delta=DELTA, planned_rounds=rounds, population=population,
        clip="adaptive", clip_initial=clip_initial, target_quantile=target_quantile, accountant=accountant)
    return RoundSettings(algorithm=algorithm, clients_per_round=cohort, local_epochs=1, lr=lr, batch_size=batch_size,
                         aggregator="mean",
                         weighting="uniform", norm_bound=0, round_timeout=60, privacy=privacy,
                         serve_average=serve_average, codec=uplink, **(server or {}))


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


def round_time(clients: list, test, repeats: int, clip_initial: float, cohort: int = 1000,
               population: int = 10_000, **described: object) -> dict:
    """Engine seconds per round at `cohort` participants without and with DP, interleaved on
    the same signed updates (see the module's docstring); `described`: what else decided the
    numbers (the data's cuts), into its measured_with."""
    started, load = time.time(), os.getloadavg()[0]
    off_settings = settings_for("fedprox", "none", cohort, population, 40, clip_initial, 0.05)
    # planned for every round folded here, so that the budget stop never ends the measurement
    central_settings = settings_for("fedprox", "8", cohort, population, max(40, repeats + 1), clip_initial, 0.05)
    for s in (off_settings, central_settings):
        s.validate()
    fed = inmemory.InMemoryFederation("synthetic_mlp", clients, test, off_settings, 0, cohort)
    devices = sorted(select(off_settings.selection, fed.devices, cohort, fed.rng, {}))
    hp = off_settings.task_hparams(1)
    updates = {}
    for device in devices:  # real local training from the initial model, encoded with the shipped codec
        payload = fed.train(device, 1, hp).payload
        updates[device] = messages.decode_answer(payload, 1 << 30, fed.keys[device], device)
    coordinators = {"off": fed.coordinator, "central": Engine(inmemory.FED, "synthetic_mlp", test,
                                                                   central_settings, seed=0, device_keys=fed.keys)}
    upload_bytes = {}

    def one_round(name: str) -> tuple[float, float]:
        c = coordinators[name]
        payloads = {d: messages.encode_update(dataclasses.replace(u, round=c.next_round, model_version=c.version),
                                              fed.keys[d]) for d, u in updates.items()}
        wall, cpu = time.perf_counter(), time.thread_time()
        if c.privacy:  # what `_attempt` does before it tasks anyone
            c.privacy.check_budget(c.next_round)
            c.privacy.cohort(fed.devices)
        else:
            select(c.settings.selection, fed.devices, cohort, c.rng, c.intake.last_metrics)
        record = fold_round(c, payloads, c.next_round)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert record.participants == len(updates), (name, record.participants, record.rejected)
        upload_bytes[name] = record.bytes_up
        return wall, cpu

    for name in coordinators:  # warm-up, untimed: first-call costs (allocations, caches)
        one_round(name)
    seconds: dict[str, list[tuple[float, float]]] = {"off": [], "central": []}
    for i in range(repeats):
        for name in (("off", "central") if i % 2 == 0 else ("central", "off")):
            seconds[name].append(one_round(name))
    wall = {k: [w for w, _ in v] for k, v in seconds.items()}
    cpu = {k: [c for _, c in v] for k, v in seconds.items()}
    off, central = statistics.median(wall["off"]), statistics.median(wall["central"])
    cpu_off, cpu_central = statistics.median(cpu["off"]), statistics.median(cpu["central"])
    private = coordinators["central"].privacy
    out = {
        "off": off, "central": central, "ratio": central / off,
        "paired_ratio": statistics.median(c / o for c, o in zip(wall["central"], wall["off"])),
        "cpu": {"off": cpu_off, "central": cpu_central, "ratio": cpu_central / cpu_off},
        "method": (f"interleaved: {repeats} rounds per coordinator (after one untimed warm-up each), order off, "
                   "central, central, off, ...; the same signed updates of the same devices, trained once; each "
                   "timed round: cohort draw (private: budget check and Poisson draw) and fold_round; medians"),
        "participants": len(updates), "bytes_up": upload_bytes,
        "wall_seconds_all": wall, "cpu_seconds_all": cpu,
        "measured_with": provenance.measured_with(
            provenance.invoked(), provenance.deciding(central_settings), delta=DELTA, sampling="poisson",
            clip="adaptive", clip_initial=clip_initial, epsilon="8", noise_multiplier=private.z,
            population=population, participants=len(updates), local_epochs=1,
            transport="in-memory (bench/inmemory.py)", **described, wall_seconds=round(time.time() - started),
            load_average=[round(load, 2), round(os.getloadavg()[0], 2)]),  # 1-minute, at start and end
    }
    print(f"round seconds at {len(updates)} participants (median of {repeats}, interleaved): off {off:.3f} s, "
          f"central {central:.3f} s ({central / off:.3f}x; paired {out['paired_ratio']:.3f}x); CPU off "
          f"{cpu_off:.3f} s, central {cpu_central:.3f} s ({cpu_central / cpu_off:.3f}x)", flush=True)
    return out


def central_reference(clients: list, test, devices: int = 1000, lr: float = 0.05, batch: int = 32) -> dict:
    """What the synthetic cohort's MLP learns in one epoch of plain SGD on the pooled data of the first
    `devices` devices (no federation, no privacy): how far the federated rows are from learnable."""
    import torch

    from edgefl_models.architectures import build_model

    x = torch.tensor(np.concatenate([np.asarray(c.x) for c in clients[:devices]]), dtype=torch.float32)
    y = torch.tensor(np.concatenate([np.asarray(c.y) for c in clients[:devices]]))
    torch.manual_seed(0)
    model = build_model("synthetic_mlp")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.randperm(len(x))
    for i in range(0, len(x), batch):
        b = order[i:i + batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
        opt.step()
    with torch.no_grad():
        accuracy = float((model(torch.tensor(np.asarray(test.x), dtype=torch.float32)).argmax(1)
                          == torch.tensor(np.asarray(test.y))).float().mean())
    return {"accuracy": accuracy, "devices": devices, "samples": len(x), "epochs": 1, "lr": lr, "batch_size": batch}


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
    ap.add_argument("--synthetic-lr", type=float, default=SYNTHETIC_LR,
                    help="the synthetic devices' learning rate (see SYNTHETIC_LR for why 0.5)")
    ap.add_argument("--synthetic-batch", type=int, default=SYNTHETIC_BATCH,
                    help="the synthetic devices' batch size (50: one local step of a capped device's 50 samples)")
    ap.add_argument("--serve-average", type=float, default=0.0,
                    help="1000of10000: [rounds] serve_average, the decay of the evaluated moving average of the "
                         "global models (0: the last model); it averages out a period-2 oscillation")
    ap.add_argument("--server-optimizer", choices=("sgd", "momentum", "adam", "yogi", "adagrad"), default="sgd",
                    help="1000of10000: [rounds] server_optimizer on the (private) folded step")
    ap.add_argument("--server-lr", type=float, default=None,
                    help="1000of10000: [rounds] server_lr (default: the optimizer's, 1 - momentum for momentum)")
    ap.add_argument("--server-momentum", type=float, default=0.9, help="1000of10000: [rounds] server_momentum")
    ap.add_argument("--codec", default=codec.DEFAULT,
                    help="1000of10000: [rounds] codec, the devices' uplink (default: the shipped one)")
    ap.add_argument("--server-lr-decay", type=float, default=1.0,
                    help="1000of10000: [rounds] server_lr_decay, the server step's decay per round (1: fixed)")
    ap.add_argument("--target-quantile", type=float, default=0.5,
                    help="1000of10000: [privacy] target_quantile, the share of updates the adaptive clip leaves whole")
    ap.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                    help="1000of10000: [privacy] accountant, which sizes the noise for each target epsilon "
                         "(pld: the tighter bound, about 7%% less noise at 1,000 of 10,000 over 40 rounds)")
    ap.add_argument("--epsilons", default=",".join(EPSILONS),
                    help="1000of10000, a probe: run only these of " + ", ".join(EPSILONS)
                         + " (cached; a result needs them all)")
    ap.add_argument("--row", default="1000of10000",
                    help="the 1000of10000 runs' row name in --out (a variant's, e.g. \"1000of10000, server "
                         "momentum 0.9\", to --combine into the main result; only the row 1000of10000 also times "
                         "the coordinator's round)")
    ap.add_argument("--only", choices=("1000of10000", "10of20"), default=None)
    ap.add_argument("--synthetic-labels", choices=("shared", "per-device"), default="shared",
                    help="one labelling model for every synthetic device (learnable), or FedProx's own per device")
    ap.add_argument("--merge", type=Path, default=None,
                    help="with --only: keep the other cohort's rows from this earlier result file")
    ap.add_argument("--combine", type=Path, nargs=2, metavar=("MAIN", "OTHER"), default=None,
                    help="no run: MAIN's result with OTHER's rows of the cohorts MAIN lacks (each run's "
                         "measured_with kept) into --out")
    ap.add_argument("--out", type=Path, default=RESULTS / "privacy.json")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild --out's rows of the cohorts the flags name, and its table, from the cached runs "
                         "(nothing is run or timed; every other field kept)")
    ap.add_argument("--round-time-only", action="store_true",
                    help="no accuracy runs: measure only round_seconds (coordinator time per round at 1,000 "
                         "participants, off and central interleaved on the same updates) and write it into the "
                         "existing --out, every other field kept")
    ap.add_argument("--round-repeats", type=int, default=15,
                    help="round_seconds: timed rounds per coordinator (after one untimed warm-up each)")
    args = ap.parse_args(argv)
    args.epsilons = epsilons(args)
    if args.combine:
        return combine(*args.combine, args.out)
    inmemory.set_threads(1)
    if args.round_time_only:
        return round_time_only(args)
    if args.report_only:
        return report_only(args)
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
        done = cached_runs(RUNS / f"1000of10000-{synthetic_sizing(args)}", args.synthetic_seeds, lambda eps, seed: run(
            f"1000of10000 eps {eps}", "synthetic_mlp", clients, test,
            synthetic_settings(args, eps),
            args.synthetic_rounds, seed), args.epsilons)
        if done is None:
            return 0  # another process runs the rest and writes the result
        runs[args.row] = done
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
    round_seconds = round_time(clients, test, args.round_repeats, args.clip_initial, **data_cuts(args)) \
        if "1000of10000" in runs and args.only != "10of20" else (merged or {}).get("round_seconds", {})
    result = {
        "measured_with": provenance.measured_with(provenance.invoked(), provenance.deciding(
            synthetic_settings(args, "8")),
            delta=DELTA, sampling="poisson", clip="adaptive", clip_initial=args.clip_initial, local_epochs=1,
            transport={"1000of10000": "in-memory (bench/inmemory.py)",
                       "10of20": "broker-coordinator simulate (bench/privacy_simulate.py)"}, cuts=cuts, wall_seconds=round(time.time() - started),
            synthetic_labels=args.synthetic_labels, synthetic_lr=args.synthetic_lr,
            synthetic_batch_size=args.synthetic_batch, serve_average=args.serve_average,
            target_quantile=args.target_quantile, accountant=args.accountant,
            **({"server_momentum": args.server_momentum} if args.server_optimizer == "momentum" else {}),
            **({"merged": {k: merged["measured_with"] for k in runs if k != args.only}} if merged else {})),
        "runs": runs,
        "accountant_check": accountant_check(args.synthetic_rounds),
        **({"central_reference": central_reference(clients, test)} if "1000of10000" in runs
           and args.only != "10of20" else {}),
        "round_seconds": round_seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(report(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def round_time_only(args: argparse.Namespace) -> int:
    """`--round-time-only`: round_seconds measured now, into the result file as it stands."""
    if not args.out.exists():
        raise SystemExit(f"{args.out} does not exist: --round-time-only updates an earlier result's round_seconds")
    result = json.loads(args.out.read_text())
    clients, test = synthetic(args.cap, args.test, args.synthetic_labels == "shared")
    result["round_seconds"] = round_time(clients, test, args.round_repeats, args.clip_initial, **data_cuts(args))
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(report(result))
    print(f"wrote round_seconds into {args.out} and {args.out.with_suffix('.md')}")
    return 0


def report_only(args: argparse.Namespace) -> int:
    """`--report-only`: the cohorts' rows of --out summarized again from their cached runs."""
    result = json.loads(args.out.read_text())
    folders = {args.row: RUNS / f"1000of10000-{synthetic_sizing(args)}",
               "10of20": RUNS / f"10of20-simulate-r{args.rounds}-clip{args.clip_initial:g}"}
    seeds = {args.row: args.synthetic_seeds, "10of20": args.seeds}
    for cohort in [args.row if args.only == "1000of10000" else args.only] if args.only else list(folders):
        files = {eps: [folders[cohort] / f"eps{eps}-seed{seed}.json" for seed in range(seeds[cohort])]
                 for eps in EPSILONS}
        if missing := [str(f) for fs in files.values() for f in fs if not f.exists()]:
            raise SystemExit(f"--report-only: no cached run {missing[0]} (and {len(missing) - 1} more)")
        result["runs"][cohort] = {eps: summarize([json.loads(f.read_text()) for f in fs]) for eps, fs in files.items()}
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(report(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} from the cached runs")
    return 0


def synthetic_sizing(args: argparse.Namespace) -> str:
    """The 1000of10000 cache folder's name: every flag that changes a run."""
    return (f"r{args.synthetic_rounds}-cap{args.cap}-test{args.test}-{args.synthetic_labels}"
            f"-clip{args.clip_initial:g}" + ("" if args.synthetic_lr == 0.05 else f"-lr{args.synthetic_lr:g}")
            + ("" if args.synthetic_batch == 32 else f"-batch{args.synthetic_batch}")
            + (f"-ema{args.serve_average:g}" if args.serve_average else "")
            + ("" if args.target_quantile == 0.5 else f"-q{args.target_quantile:g}")
            + ("" if args.codec == codec.DEFAULT else f"-{args.codec}")
            + ("" if args.accountant == "rdp" else f"-{args.accountant}")
            + "".join(f"-{k.replace('_', '')}{v:g}" if isinstance(v, float) else f"-{v}"
                      for k, v in server_of(args).items()))


def epsilons(args: argparse.Namespace) -> tuple[str, ...]:
    """--epsilons as a tuple in EPSILONS' order (a comparison with EPSILONS says whether it is a probe)."""
    chosen = tuple(e for e in EPSILONS if e in args.epsilons.split(","))
    unknown = set(args.epsilons.split(",")) - set(EPSILONS)
    if unknown or not chosen:
        raise SystemExit(f"--epsilons takes some of {', '.join(EPSILONS)}, got {args.epsilons!r}")
    return chosen


def synthetic_settings(args: argparse.Namespace, epsilon: str) -> RoundSettings:
    """The 1000of10000 cohort's settings at `epsilon`, as the flags size them."""
    return settings_for("fedprox", epsilon, 1000, 10_000, args.synthetic_rounds, args.clip_initial,
                        args.synthetic_lr, args.synthetic_batch, args.serve_average, server_of(args),
                        args.target_quantile, args.codec, args.accountant)


def server_of(args: argparse.Namespace) -> dict:
    """The [rounds] server optimizer keys the flags set (empty: the plain server rule)."""
    decay = {} if args.server_lr_decay == 1.0 else {"server_lr_decay": args.server_lr_decay}
    if args.server_optimizer == "sgd":
        return ({} if args.server_lr is None else {"server_lr": args.server_lr}) | decay
    return {"server_optimizer": args.server_optimizer, "server_momentum": args.server_momentum,
            **({} if args.server_lr is None else {"server_lr": args.server_lr}), **decay}


def data_cuts(args: argparse.Namespace) -> dict:
    return {"synthetic_cap": args.cap, "synthetic_test": args.test, "synthetic_labels": args.synthetic_labels}


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


def cached_runs(folder: Path, seeds: int, one_run: Callable[[str, int], dict],
                epsilons: tuple[str, ...] = EPSILONS) -> dict | None:
    """Each epsilon's summary over `seeds` seeds, every run cached in `folder`; None when runs that
    another process claimed are still going (that process, finishing last, gets the whole set)."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(eps, seed) for seed in range(seeds) for eps in epsilons]  # seed 0 of every epsilon first
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
    if epsilons != EPSILONS:
        print(f"probe done: {folder}/eps{{{','.join(epsilons)}}}-seed*.json (a result needs every epsilon)", flush=True)
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
            "final_accuracy_mean": statistics.mean(r["final_accuracy"] for r in per_seed),
            # a period-2 oscillation puts round 40 on a high or a low phase: the mean of the last two says which
            "last_two_mean": [statistics.mean(t["accuracy"] for t in r["trace"][-2:]) for r in per_seed],
            "epsilon_spent": per_seed[0]["epsilon_spent"], "noise_multiplier": per_seed[0]["noise_multiplier"],
            "round_seconds": statistics.median(seconds) if seconds else None,
            "trace": per_seed[0]["trace"]}


def report(result: dict) -> str:
    m = result["measured_with"]
    lines = ["# Accuracy against epsilon (user-level central DP)", "",
             f"`{m['command']}` on commit {m['commit']}, {m['wall_seconds']} s; delta {m['delta']:g}, Poisson "
             "sampling, adaptive clipping; 1000of10000 through the in-memory engine (bench/inmemory.py), 10of20 "
             "through `broker-coordinator simulate` (bench/privacy_simulate.py). "
             + (f"The synthetic devices train at lr {m['synthetic_lr']:g} in batches of {m['synthetic_batch_size']} "
                f"(50: one local step of a capped device's 50 samples). " if "synthetic_batch_size" in m else "")
             + (f"Cut to fit the machine: {'; '.join(m['cuts'])}." if m["cuts"] else ""), "",
             "| cohort | epsilon | z | epsilon spent | final accuracy (per seed) | mean | mean of the last two rounds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for cohort, rows in result["runs"].items():
        for eps, row in rows.items():
            acc = row["final_accuracy"]
            z = f"{row['noise_multiplier']:.3f}" if row["noise_multiplier"] else "-"
            spent = f"{row['epsilon_spent']:.3f}" if row["epsilon_spent"] is not None else "-"
            lines.append(f"| {cohort} | {eps} | {z} | {spent} | {', '.join(f'{100 * a:.2f}' for a in acc)} | "
                         f"{100 * statistics.mean(acc):.2f} | "
                         + (f"{100 * statistics.mean(row['last_two_mean']):.2f} |" if "last_two_mean" in row else "- |"))
    check = result["accountant_check"]
    lines += ["", (f"Accountant check (q {check['q']}, z {check['z']}, {check['rounds']} rounds): ours "
                   f"({check['ours_accountant']}) {check['ours']:.4f}, second ({check['second_accountant']}) "
                   f"{check['second']:.4f}, {100 * abs(check['ours'] / check['second'] - 1):.3f}% apart; RDP "
                   f"{check['rdp']:.4f}.")]
    if result["round_seconds"]:
        rs = result["round_seconds"]
        line = (f"Engine time per round at 1,000 participants (median): off {rs['off']:.3f} s, central "
                f"{rs['central']:.3f} s ({rs['central'] / rs['off']:.3f}x, target at most 1.05x)")
        if "cpu" in rs:
            line += (f"; CPU {rs['cpu']['off']:.3f} s and {rs['cpu']['central']:.3f} s ({rs['cpu']['ratio']:.3f}x); "
                     f"{rs['method']} (`{rs['measured_with']['command']}`, commit {rs['measured_with']['commit']})")
        lines.append(line + ".")
    for cohort, rows in result["runs"].items():
        lines += plateau_warning(cohort, rows.get("none"))
    if "central_reference" in result:
        ref = result["central_reference"]
        lines.append(f"For reference, the same MLP trained centrally for one epoch of SGD (lr {ref['lr']:g}, batch "
                     f"{ref['batch_size']}) on the pooled data of the first {ref['devices']:,} synthetic devices "
                     f"({ref['samples']:,} samples) scores {100 * ref['accuracy']:.2f}% on the same test set.")
    if "10of20" in result["runs"]:
        lines.append("The 10-of-20 rows give no useful privacy: with q = 0.5 and 10 devices per round, the noise "
                     "a meaningful epsilon needs is larger than the clipped updates it hides.")
    return "\n".join(lines) + "\n"


def plateau_warning(cohort: str, none: dict | None, after: int = 5, points: float = 1.0) -> list[str]:
    """A sentence when the non-private run stopped improving early: then its rows measure DP's cost
    at that plateau, not on a model that is still learning (the cost would show later)."""
    trace = (none or {}).get("trace") or []
    if len(trace) <= after:
        return []
    early, final = trace[after - 1]["accuracy"], trace[-1]["accuracy"]
    if final - early >= points / 100:
        return []
    return [(f"Without privacy the {cohort} run (seed 0) was at {100 * early:.2f}% after round {after} and ended at "
            f"{100 * final:.2f}% after {len(trace)}: it stopped improving early, so these rows measure what DP "
            "costs on a plateau, not on a model that is still learning.")]


if __name__ == "__main__":
    raise SystemExit(main())
