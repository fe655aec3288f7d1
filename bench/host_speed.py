"""The host speed the in-memory benchmarks emulate their devices from, pinned in a file.

A device of the benchmarks' fleet chooses its local epochs from its speed (`hardware.plan_epochs`):
this machine's training throughput per CPU-second of one thread, times its class's speed
(`broker_coordinator.simulation.fleet.PROFILES`). Calibrated afresh in every process, that
throughput varied by up to 14% from one worker to the next (3,087 and 3,521 samples/s for the MNIST
MLP), enough to give some devices another epoch and to move a run's final accuracy by about half a
point. Pinned, every process and every rerun plans the same epochs, so a cached run and its rerun
give the same model.

    python -m bench.host_speed            # show the pinned speeds
    python -m bench.host_speed --pin      # calibrate every built-in model (a quiet machine) and pin

`bench/host_speed.json` is committed with the benchmarks' results: a rerun on another machine
emulates the same fleet (its wall time differs, its devices' epochs do not). A model without a
pinned speed is calibrated once per process, as before, and says so in the log.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

PINNED = Path(__file__).resolve().parent / "host_speed.json"
CALIBRATIONS = 5  # median of this many, each on a fresh model
log = logging.getLogger(__name__)


def pinned(path: Path | None = None) -> dict[str, float]:
    """{arch: samples per CPU-second}; empty when no file is pinned."""
    path = path or PINNED
    if not path.exists():
        return {}
    try:
        return {arch: float(v) for arch, v in json.loads(path.read_text())["samples_per_cpu_s"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a pinned host speed file ({exc}): delete it and run "
                         f"python -m bench.host_speed --pin") from None


def calibrate(arch: str) -> float:
    """This thread's training throughput for `arch` by CPU time (other jobs on the host barely move it)."""
    from edge_agent.hardware import calibrate as measure
    from edgefl_models.architectures import build_model, resolve
    return measure(build_model(arch), resolve(arch).input_shape, max_steps=2000, clock=time.thread_time)


def pin(archs: list[str], path: Path | None = None) -> dict:
    import torch
    path = path or PINNED
    torch.set_num_threads(1)
    speeds = {a: round(statistics.median(calibrate(a) for _ in range(CALIBRATIONS)), 1) for a in archs}
    out = {"samples_per_cpu_s": speeds,
           "measured": {"how": f"median of {CALIBRATIONS} calibrations (edge_agent.hardware.calibrate, "
                               f"thread CPU time, one torch thread)",
                        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(path)
    return out


def main(argv: list[str] | None = None) -> int:
    from edgefl_models.architectures import ARCHITECTURES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pin", action="store_true", help="calibrate and write bench/host_speed.json")
    ap.add_argument("--archs", default=",".join(ARCHITECTURES), help="comma-separated models to pin")
    args = ap.parse_args(argv)
    if args.pin:
        pin(args.archs.split(","))
    print(json.dumps(pinned(), indent=1) if PINNED.exists() else f"nothing pinned: {PINNED} does not exist")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
