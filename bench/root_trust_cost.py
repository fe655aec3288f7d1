"""What `[fold] root_trust` costs the coordinator per round: `make root-trust-cost`.

Once per model version the coordinator trains the round's model on its root data (two epochs of
plain SGD, batch 32: `aggregation/reference.py`) and keeps the update; each device's update then
costs one dot product with it. For each model and root-set size this times that training from a
fresh model version, REPEATS times (the median, one torch thread, as the coordinator's process
runs it beside its intake), and the per-update scoring of a dense and a top-k update against a
plain fold. Writes bench/results/root_trust_cost.json and .md.

What this is not: the coordinator's whole round. That is bench/runtime.py; this is what root_trust adds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import provenance  # noqa: E402

MODELS = {"mnist_mlp": "mnist5k", "mnist_cnn": "mnist5k", "logreg60": "synthetic", "digits_mlp": "digits"}
SIZES = (100, 200, 500)
REPEATS = 5
UPDATES = 200  # updates scored per fold timing
PASSES = 5  # fold timings per variant (the median)


def _data(name: str):
    from edgefl_models import datasets
    if name == "synthetic":
        return datasets.load_synthetic(1.0, 1.0, num_users=30, seed=0).train
    return (datasets.load_mnist5k() if name == "mnist5k" else datasets.load("digits")).train


def training_seconds(arch: str, root, size: int) -> float:
    """Median seconds of one root update (a new model version each time, as each round brings)."""
    from broker_coordinator.aggregation.reference import RootUpdates
    from edgefl_models.architectures import build_model, get_weights
    updates = RootUpdates(arch, root.subset(range(size)))
    times = []
    for version in range(REPEATS):
        weights = get_weights(build_model(arch))
        started = time.perf_counter()
        updates.of(version, weights, lr=0.05, seed=version)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def scoring_microseconds(arch: str, root_set, sparse: bool) -> dict[str, float]:
    """Median microseconds per update folded by the default fold, without and with the trust score."""
    import numpy as np

    from broker_coordinator.aggregation.reference import RootUpdates, flattened
    from broker_coordinator.aggregation.robust import RobustRound
    from broker_coordinator.aggregation.trust import NormBound
    from edgefl_models.architectures import build_model, get_weights
    from edgefl_protocol.sparse_delta import SparseDelta

    weights = get_weights(build_model(arch))
    step = RootUpdates(arch, root_set.subset(range(200))).of(0, weights, lr=0.05, seed=0)
    specs = {n: tuple(a.shape) for n, a in weights.items()}
    rng = np.random.default_rng(0)
    size = sum(a.size for a in weights.values())
    root = flattened(step, list(specs))
    scale = float(np.std(root))
    deltas = []  # each near the root update (its cosine about 0.5), so that every one is folded
    for _ in range(UPDATES):
        if sparse:
            positions = np.sort(rng.choice(size, size // 10, replace=False))
            values = root[positions] + scale * rng.standard_normal(len(positions))
            deltas.append(SparseDelta(tuple(specs), tuple(specs.values()), positions, values.astype(np.float32)))
        else:
            flat = root + scale * rng.standard_normal(size)
            deltas.append({n: flat[o:o + a.size].reshape(a.shape).astype(np.float32)
                           for (n, a), o in zip(weights.items(), np.cumsum([0] + [a.size for a in weights.values()]))})
    times: dict[str, list[float]] = {"plain": [], "root_trust": []}
    for _ in range(PASSES):  # alternating, so that warm-up and drift land on both
        for label, trust in (("plain", None), ("root_trust", lambda names: flattened(step, names))):
            center = {n: np.zeros(s, np.float32) for n, s in specs.items()}
            rnd = RobustRound(specs, NormBound(multiplier=0), "centered_clip", center=center, trust=trust)
            rnd.add("warm-up", deltas[0], 1.0)  # the sketcher built and the root update flattened off the clock
            started = time.perf_counter()
            for i, delta in enumerate(deltas):
                rnd.add(f"d{i}", delta, 1.0)
            times[label].append(1e6 * (time.perf_counter() - started) / UPDATES)
    return {label: statistics.median(t) for label, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.root_trust_cost", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    rows = []
    for arch, data in MODELS.items():
        root = _data(data)
        training = {size: training_seconds(arch, root, size) for size in SIZES}
        scoring = scoring_microseconds(arch, root, sparse=arch in ("mnist_mlp", "mnist_cnn"))
        rows.append({"model": arch, "root_update_seconds": training, "per_update_us": scoring})
    result = {"measured_with": provenance.measured_with(
        provenance.invoked(), {"root_trust": True}, models=list(MODELS), root_sizes=list(SIZES), repeats=REPEATS,
        epochs=2, batch_size=32, torch_threads=1, scored_updates=UPDATES,
        note="the root update from a fresh model each time; top-k (10%) updates for the MNIST models, "
             "as the default codec sends them, dense for the small ones"), "models": rows}
    lines = ["# What root_trust costs the coordinator", "",
             f"Written by `{result['measured_with']['command']}` at {result['measured_with']['commit']}: the median "
             f"of {REPEATS} root updates (two epochs of plain SGD, batch 32, one torch thread), once per round; "
             f"and the default fold's time per update without and with the score (the median of {PASSES} passes of "
             f"{UPDATES} updates).", "",
             "| model | " + " | ".join(f"root update, {n} examples (s)" for n in SIZES)
             + " | per update, plain (us) | per update, root_trust (us) |",
             "|---|" + "---:|" * (len(SIZES) + 2)]
    for row in rows:
        lines.append(f"| {row['model']} | " + " | ".join(f"{row['root_update_seconds'][n]:.3f}" for n in SIZES)
                     + f" | {row['per_update_us']['plain']:.0f} | {row['per_update_us']['root_trust']:.0f} |")
    provenance.write_result("root_trust_cost", result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
