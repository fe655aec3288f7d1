"""The 10-of-20 privacy rows through `broker-coordinator simulate` (bench/privacy.py's `10of20`).

One run is a real federation: a private Mosquitto, one agent process per device (20) with its shard
of the headline MNIST partition (bench/data/mnist5k_dir01_20clients.npz), the coordinator reading
`[rounds]` and `[privacy]` from a config file exactly as `run` would. The `[rounds]` section is the
one bench/privacy.py folds in memory for the other cohort (FedAvg, uniform weights, the mean fold,
no norm bound, one local epoch), so that only `[privacy]` differs between epsilons.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PARTITION_FILE = PROJECT_ROOT / "bench" / "data" / "mnist5k_dir01_20clients.npz"
AGENTS, PER_ROUND = 20, 10


def config_text(epsilon: str, rounds: int, clip_initial: float, delta: float, lr: float = 0.05) -> str:
    rounds_section = (f'[rounds]\nalgorithm = "fedavg"\nclients_per_round = {PER_ROUND}\nlocal_epochs = 1\n'
                      f'lr = {lr}\naggregator = "mean"\nweighting = "uniform"\nnorm_bound = 0\nround_timeout = 120\n')
    if epsilon == "none":
        return rounds_section
    return rounds_section + (f'[privacy]\nmode = "central"\ntarget_epsilon = {float(epsilon)}\ndelta = {delta}\n'
                             f'planned_rounds = {rounds}\npopulation = {AGENTS}\nclip = "adaptive"\n'
                             f'clip_initial = {clip_initial}\nsampling = "poisson"\n')


def simulate_run(epsilon: str, seed: int, rounds: int, clip_initial: float, delta: float) -> dict:
    """One federation; the same keys as bench/privacy.py's in-memory `run`."""
    with tempfile.TemporaryDirectory(prefix="edgefl-privacy-") as tmp:
        config, out = Path(tmp) / "privacy.toml", Path(tmp) / "out"
        config.write_text(config_text(epsilon, rounds, clip_initial, delta))
        command = [sys.executable, "-m", "broker_coordinator", "simulate", "--config", str(config),
                   "--agents", str(AGENTS), "--rounds", str(rounds), "--partition-file", str(PARTITION_FILE),
                   "--seed", str(seed), "--out", str(out), "--log-level", "WARNING"]
        result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"simulate failed (exit {result.returncode}): {result.stderr[-2000:]}")
        history = json.loads((out / "history.json").read_text())["rounds"]
    trace = []
    for record in history:
        private = record.get("privacy") or {}
        trace.append({"round": record["round"], "accuracy": record.get("accuracy"),
                      "participants": record.get("participants"), "seconds": record.get("seconds"),
                      "bytes_up": record.get("bytes_up"),
                      **{k: private[k] for k in ("epsilon", "clip", "noise_std", "unclipped_fraction")
                         if k in private}})
    last = history[-1]
    private = last.get("privacy") or {}
    print(f"10of20 (simulate) eps {epsilon} seed {seed}: {100 * last['accuracy']:.2f}% after {len(history)} "
          f"rounds" + (f", epsilon {private['epsilon']:.3f}" if private else ""), flush=True)
    return {"final_accuracy": last["accuracy"], "epsilon_spent": private.get("epsilon"),
            "noise_multiplier": private.get("noise_multiplier"), "trace": trace,
            "transport": "broker-coordinator simulate (real Mosquitto, 20 agent processes)"}
