"""A probe, not a shipped stage: FLAME's clustering (Nguyen et al., USENIX Security 2022) as the
agreement stage's rule, on the sketches that stage keeps. At a round's close, HDBSCAN over the
cosine distances of the round's sketches (min_cluster_size = n/2 + 1) flags every update outside
the majority cluster; with `verdict_banks = 8` a flag holds back its own round's partial sum.
What it measured (it does not stop the backdoor and flags a third of honest updates) is in
docs/RESEARCH.md, "Probes" and "FLAME's clustering on the stage's sketches".

    python -m research.probe_flame backdoor@0.1,backdoor@0.2,clean,S:clean 1,2   # S: Synthetic(1,1)
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Mapping

import numpy as np

from bench import attacks, attacks_report
from broker_coordinator.aggregation import consensus

FOLD = "centered_clip+banks8"


def majority_cluster_outliers(sketches: Mapping[str, np.ndarray], floor: float = 0.0) -> dict[str, float]:
    """`consensus.disagreeing`'s contract (device -> its median cosine, for the flagged), FLAME's rule."""
    if len(sketches) < consensus.MIN_JUDGED:
        return {}
    from sklearn.cluster import HDBSCAN
    devices = list(sketches)
    unit = np.stack([np.asarray(sketches[d], dtype=np.float64) for d in devices])
    unit /= np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
    distance = np.clip(1.0 - unit @ unit.T, 0.0, 2.0)
    labels = HDBSCAN(metric="precomputed", min_cluster_size=len(devices) // 2 + 1, min_samples=1,
                     allow_single_cluster=True).fit_predict(distance)
    medians = consensus.median_cosines(unit)
    return {d: float(m) for d, label, m in zip(devices, labels, medians) if label == -1}


def one(job: tuple[str, int]) -> tuple:
    run, seed = job
    consensus.disagreeing = majority_cluster_outliers  # this worker process only
    synthetic = run.startswith("S:")
    partition = attacks_report.SECOND if synthetic else attacks_report.HEADLINE
    rounds = attacks.SECOND_ROUNDS if synthetic else attacks.ROUNDS
    r = attacks.run_one(partition, run.removeprefix("S:"), FOLD, seed, rounds)
    return run, seed, r["final_accuracy"], r.get("attack_success"), r["clipped"]


def main(argv: list[str]) -> int:
    runs, seeds = argv[0].split(","), [int(s) for s in argv[1].split(",")]
    with ProcessPoolExecutor(2) as pool:
        for run, seed, accuracy, success, clipped in pool.map(one, [(r, s) for r in runs for s in seeds]):
            asr = "" if success is None else f", backdoor success {100 * success:.1f}%"
            print(f"{run} seed {seed}: {100 * accuracy:.2f}%{asr}; bounded {clipped}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
