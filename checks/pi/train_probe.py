"""Twenty training steps of one built-in model from given weights and batches, on whatever CPU runs it.

`make pi-check` runs this on the host (x86) and in the arm64 root under qemu
(Pi 4 and Pi 5 CPUs), from the same inputs file, and compares the losses. The
step is the agent's own: edge_agent.training.forward_backward, gradient
clipping and edge_agent.optim.LocalSGD with the runtime's default settings.

    python checks/pi/train_probe.py make-inputs MODEL FILE.npz     # weights and batches, seed 0
    python checks/pi/train_probe.py train FILE.npz OUT.json [--threads N | --default-threads-for CORES]
    python checks/pi/train_probe.py local-round FILE.npz OUT.json [--dp] [--threads N]   # make pi-dp-sgd

`local-round` is one device's local round (FedAvg, one epoch over the first 250 of the inputs'
samples, batch 32) with or without sample-level DP-SGD (z 1.0, C 1.0), timed apart from importing
Opacus: what `make dp-sgd-cost` measures on this host and `make pi-dp-sgd` under emulation.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

STEPS, BATCH = 20, 32
ROUND_SAMPLES, DP_NOISE, DP_CLIP = 250, 1.0, 1.0  # local-round: the sizes `make dp-sgd-cost` uses
DATASETS = {"mnist_cnn": "mnist5k", "mnist_mlp": "mnist5k", "digits_mlp": "digits", "logreg60": "synthetic"}


def make_inputs(model_name: str, path: Path) -> None:
    """The model's initial weights (seed 0) and 20 batches of its own dataset, drawn with seed 0."""
    from edgefl_models import datasets
    from edgefl_models.architectures import build_model, get_weights
    train = datasets.load(DATASETS[model_name]).train
    index = np.random.default_rng(0).choice(len(train.y), STEPS * BATCH, replace=len(train.y) < STEPS * BATCH)
    x = train.x[index].reshape(STEPS, BATCH, *train.x.shape[1:]).astype(np.float32)
    y = train.y[index].reshape(STEPS, BATCH).astype(np.int64)
    weights = get_weights(build_model(model_name, seed=0))
    np.savez(path, model=np.array(model_name), x=x, y=y, **{f"w.{k}": v for k, v in weights.items()})


def train(inputs: Path, threads: int) -> dict:
    from edge_agent.optim import LocalSGD
    from edge_agent.training import forward_backward
    from edgefl_models.architectures import build_model, set_weights

    torch.set_num_threads(threads)
    data = np.load(inputs)
    name = str(data["model"])
    model = build_model(name)
    set_weights(model, {k[2:]: data[k] for k in data.files if k.startswith("w.")})
    params = list(model.parameters())
    optimizer = LocalSGD(params, lr=0.05, weight_decay=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    losses, started = [], time.perf_counter()
    for step in range(STEPS):
        losses.append(forward_backward(model, loss_fn, torch.from_numpy(data["x"][step]),
                                       torch.from_numpy(data["y"][step])))
        nn.utils.clip_grad_norm_(params, 10.0)
        optimizer.step()
    return {"model": name, "threads": torch.get_num_threads(), "steps": STEPS, "losses": losses,
            "final_loss": losses[-1], "seconds": round(time.perf_counter() - started, 2),
            "torch": torch.__version__, "cuda": torch.version.cuda, "machine": platform.machine()}


def local_round(model: nn.Module, x: np.ndarray, y: np.ndarray, private: bool) -> dict:
    """One local round of the agent's own training (edge_agent.training.train_locally): its seconds,
    the seconds importing Opacus took before it (once per agent process) and the process's peak RSS."""
    import resource

    from edge_agent import dp_sgd
    from edge_agent.training import LocalSettings, train_locally
    from edgefl_protocol import algorithms
    from edgefl_models.datasets import Dataset

    dp = dp_sgd.DeviceDP(DP_NOISE, DP_CLIP, 1e-5) if private else None
    settings = LocalSettings(epochs=1, batch_size=BATCH, lr=0.05, dp=dp)
    rule = algorithms.get("fedavg").client({}, {}, {}, {})
    started = time.perf_counter()
    if private:
        import opacus  # noqa: F401
    imported = time.perf_counter()
    result = train_locally(model, Dataset(x, y), rule, settings, seed=0)
    # the DP-SGD path reports its sampling rate: proof that the private round ran privately
    return {"seconds": time.perf_counter() - imported, "import_seconds": imported - started,
            "dp_sgd_ran": "dp_sample_rate" in result.metrics,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "torch": torch.__version__}


def local_round_from(inputs: Path, private: bool) -> dict:
    from edgefl_models.architectures import build_model, set_weights

    data = np.load(inputs)
    model = build_model(str(data["model"]))
    set_weights(model, {k[2:]: data[k] for k in data.files if k.startswith("w.")})
    x = data["x"].reshape(-1, *data["x"].shape[2:])[:ROUND_SAMPLES]
    y = data["y"].reshape(-1)[:ROUND_SAMPLES]
    return local_round(model, x, y, private)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-inputs")
    make.add_argument("model")
    make.add_argument("path", type=Path)
    run = sub.add_parser("train")
    run.add_argument("inputs", type=Path)
    run.add_argument("out", type=Path)
    run.add_argument("--threads", type=int, default=0)
    run.add_argument("--default-threads-for", type=int, default=4, metavar="CORES",
                     help="with --threads 0: the agent's default for a device with this many cores")
    one = sub.add_parser("local-round")
    one.add_argument("inputs", type=Path)
    one.add_argument("out", type=Path)
    one.add_argument("--dp", action="store_true", help="with sample-level DP-SGD")
    one.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.command == "local-round":
        torch.set_num_threads(args.threads)
        args.out.write_text(json.dumps(local_round_from(args.inputs, args.dp)))
        return 0
    if args.command == "make-inputs":
        make_inputs(args.model, args.path)
        return 0
    from edge_agent.hardware import default_threads
    threads = args.threads or default_threads(args.default_threads_for)
    args.out.write_text(json.dumps(train(args.inputs, threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
