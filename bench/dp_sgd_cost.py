"""What sample-level DP-SGD costs a device (`[privacy] device = "dp-sgd"`): `make dp-sgd-cost`.

For each model, one device's local round (FedAvg, one epoch over 250 MNIST-5k or digits samples, batch
32) with and without DP-SGD (z 1.0, C 1.0), in a child process under a device class's CPU quota
and memory limit (cgroups, as `simulate --fleet` emulates them; default pi4: 0.40 of a core and
1,920 MB), 3 times each, alternating; the medians of the training seconds and the ratio, and the
child's peak RSS. Where the machine gives no cgroups (not root), it says so and runs unlimited.

What this is not: an aarch64 measurement. The quota emulates a Pi 4's speed on this x86 host; the
per-example gradients' share of the work is what the ratio measures (`make pi-check` runs the Pi
install itself under QEMU). Writes bench/results/dp_sgd_cost.json and dp_sgd_cost.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import provenance  # noqa: E402
from broker_coordinator.simulation.fleet import PROFILES, CgroupUnavailable, Cgroups, join_command  # noqa: E402
from checks.pi.train_probe import DP_CLIP, DP_NOISE, ROUND_SAMPLES  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODELS = {"mnist_cnn": "mnist5k", "digits_mlp": "digits"}
# what decides a local round's cost here and in checks/pi/dp_sgd_pi.py (checks/pi/train_probe.py's local_round)
DECIDING = {"algorithm": "fedavg", "epochs": 1, "batch_size": 32, "samples": ROUND_SAMPLES,
            "noise_multiplier": DP_NOISE, "clip": DP_CLIP, "torch_threads": 1}


def alternating(repeats: int, one: Callable[[bool], dict]) -> dict[str, list[dict]]:
    """`repeats` plain and DP-SGD rounds, alternating so that drift lands on both."""
    runs: dict[str, list[dict]] = {"plain": [], "dp_sgd": []}
    for _ in range(repeats):
        for kind in ("plain", "dp_sgd"):
            runs[kind].append(one(kind == "dp_sgd"))
    return runs


def timings(runs: dict[str, list[dict]]) -> dict:
    """Median training seconds of each kind, their ratio and the median Opacus import."""
    plain = statistics.median(r["seconds"] for r in runs["plain"])
    private = statistics.median(r["seconds"] for r in runs["dp_sgd"])
    return {"plain_seconds": plain, "dp_sgd_seconds": private, "ratio": private / plain,
            "opacus_import_seconds": statistics.median(r["import_seconds"] for r in runs["dp_sgd"])}


def one_round(arch: str, private: bool) -> dict:
    """In the child: one local round, its training seconds and the process's peak RSS."""
    import numpy as np
    import torch

    from checks.pi.train_probe import local_round
    from edgefl_models import datasets
    from edgefl_models.architectures import build_model

    torch.set_num_threads(1)
    data = datasets.load(MODELS[arch]).train.subset(np.arange(ROUND_SAMPLES))
    return local_round(build_model(arch), data.x, data.y, private)


def measure(arch: str, private: bool, limits: list[Path] | None) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "_child", arch, "1" if private else "0"]
    command = join_command(limits, argv) if limits else argv
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{arch} child failed: {done.stderr[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-class", default="pi4", choices=sorted(PROFILES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = PROFILES[args.device_class]
    cgroups, limits, note = None, None, f"{device.name}: {device.speed:.2f} of a core, {device.memory_limit_mb} MB"
    try:
        cgroups = Cgroups(f"edgefl-dpsgd-{int(time.time())}")
        limits = cgroups.limit("device", device.speed, device.memory_limit_mb)
    except (CgroupUnavailable, OSError) as exc:
        note = f"no cgroups ({exc}): unlimited, this host's full core"
    rows = {}
    try:
        for arch in MODELS:
            runs = alternating(args.repeats, lambda private: measure(arch, private, limits))
            rows[arch] = {**timings(runs), "plain_peak_rss_mb": max(r["peak_rss_mb"] for r in runs["plain"]),
                          "dp_sgd_peak_rss_mb": max(r["peak_rss_mb"] for r in runs["dp_sgd"]), "runs": runs}
            plain, private = rows[arch]["plain_seconds"], rows[arch]["dp_sgd_seconds"]
            print(f"{arch}: {plain:.2f} s plain, {private:.2f} s with DP-SGD ({private / plain:.2f}x)", flush=True)
    finally:
        if cgroups is not None:
            cgroups.remove()
    result = {"measured_with": provenance.measured_with(provenance.invoked(), {**DECIDING, "device_class": note}),
              "models": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dp_sgd_cost.json").write_text(json.dumps(result, indent=1))
    lines = ["# DP-SGD on the device: the cost of a local round", "",
             f"`{result['measured_with'].get('command', 'python -m bench.dp_sgd_cost')}`; {note}; FedAvg, one epoch "
             f"of {ROUND_SAMPLES} samples, batch 32, z {DP_NOISE}, C {DP_CLIP}; medians of {args.repeats} alternating runs. "
             "Emulated by a CPU quota on x86, not measured on aarch64.", "",
             "Training seconds exclude importing Opacus, once per agent process (its own column).", "",
             "| model | plain s | DP-SGD s | ratio | Opacus import s | peak RSS plain / DP-SGD MB |",
             "|---|---:|---:|---:|---:|---:|"]
    for arch, r in rows.items():
        lines.append(f"| {arch} | {r['plain_seconds']:.2f} | {r['dp_sgd_seconds']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['opacus_import_seconds']:.1f} | "
                     f"{r['plain_peak_rss_mb']:.0f} / {r['dp_sgd_peak_rss_mb']:.0f} |")
    (RESULTS / "dp_sgd_cost.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "dp_sgd_cost.md").read_text())
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        print(json.dumps(one_round(sys.argv[2], sys.argv[3] == "1")))
        sys.exit(0)
    sys.exit(main())
