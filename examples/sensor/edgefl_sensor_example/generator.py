"""Stands in for a device's sensor application: keeps writing motion windows into the device's spool.

    python -m edgefl_sensor_example.generator --spool /var/lib/edgefl/spool --device 0 --devices 4

Every `--interval` seconds it writes one `.npz` batch (x float32 (B, 6, 80), y int64 (B,)) by atomic
rename: the bytes go to `NAME.npz.tmp`, which the agent ignores, and `os.replace` makes `NAME.npz`
appear whole. BasicMotions has only 40 training recordings of 10 s, so the generator *replays* this
device's share of them (basicmotions.device_share) as an augmented stream: each window is a random
8-second crop of one recording, scaled by a random gain in [0.9, 1.1] and with Gaussian noise of 5% of
each channel's spread added. Nothing new is measured; the stream is the same few recordings, varied.
The test recordings are never written. It stops on SIGTERM/SIGINT, after `--files` batches, and
pauses while `--max-pending` unread batches wait in the spool (a sensor buffer that is full).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from . import basicmotions
from .basicmotions import WINDOW

GAIN = (0.9, 1.1)
NOISE = 0.05  # of each channel's standard deviation


class Stream:
    """Augmented windows from one device's recordings."""

    def __init__(self, x: np.ndarray, y: np.ndarray, seed: int) -> None:
        self.x, self.y = x, y
        self.noise = NOISE * x.std(axis=(0, 2), keepdims=True)[0]  # (6, 1)
        self.rng = np.random.default_rng(seed)

    def batch(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        pick = self.rng.integers(0, len(self.y), size)
        start = self.rng.integers(0, basicmotions.LENGTH - WINDOW + 1, size)
        x = np.stack([self.x[i, :, s:s + WINDOW] for i, s in zip(pick, start)])
        x = x * self.rng.uniform(*GAIN, (size, 1, 1)) + self.noise * self.rng.standard_normal(x.shape)
        return x.astype(np.float32), self.y[pick]


def write_batch(spool: Path, name: str, x: np.ndarray, y: np.ndarray) -> None:
    """Atomic: the agent sees either no NAME.npz or all of it."""
    tmp = spool / f"{name}.tmp"
    with open(tmp, "wb") as handle:
        np.savez(handle, x=x, y=y)
        handle.flush()
        os.fsync(handle.fileno())  # the bytes are on disk before the name is
    os.replace(tmp, spool / name)


def pending(spool: Path) -> int:
    with os.scandir(spool) as entries:
        return sum(1 for e in entries if e.name.endswith(".npz") and not e.name.startswith("."))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m edgefl_sensor_example.generator",
                                     description="write augmented BasicMotions windows into a device's spool")
    parser.add_argument("--spool", type=Path, required=True, help="the device's spool directory (created)")
    parser.add_argument("--device", type=int, required=True, help="which device's share: 0..DEVICES-1")
    parser.add_argument("--devices", type=int, default=4, help="how many devices share the recordings (>= 4)")
    parser.add_argument("--batch", type=int, default=8, help="windows per file")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between files")
    parser.add_argument("--files", type=int, default=0, help="stop after this many files; 0 = until stopped")
    parser.add_argument("--max-pending", type=int, default=1000,
                        help="pause while this many unread .npz files wait in the spool")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, low in (("batch", 1), ("files", 0), ("max_pending", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.interval < 0:
        parser.error(f"--interval must be >= 0 seconds, got {args.interval}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        basicmotions.check_device(args.device, args.devices)  # before the data is read: a typo fails fast
        x, y = basicmotions.load("train")
        share = basicmotions.device_share(y, args.device, args.devices)
        args.spool.mkdir(parents=True, exist_ok=True)
    except (basicmotions.DataMissing, ValueError, OSError) as exc:
        print(f"generator: error: {exc}", file=sys.stderr)
        return 2
    stream = Stream(x[share], y[share], seed=args.seed * 1000 + args.device)
    counts = ", ".join(f"{basicmotions.ACTIVITIES[c]} {n}" for c, n in enumerate(np.bincount(y[share], minlength=4)) if n)
    print(f"generator: device {args.device} of {args.devices}: {len(share)} recordings ({counts}); "
          f"{args.batch} windows every {args.interval:g} s into {args.spool}", flush=True)

    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    run = f"motion-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"  # unique across restarts
    written = 0
    while not stopping and (args.files == 0 or written < args.files):
        if pending(args.spool) < args.max_pending:
            xb, yb = stream.batch(args.batch)
            try:
                write_batch(args.spool, f"{run}-{written:07d}.npz", xb, yb)
            except OSError as exc:
                print(f"generator: error: cannot write into {args.spool}: {exc}", file=sys.stderr)
                return 1
            written += 1
        time.sleep(args.interval)
    print(f"generator: device {args.device}: stopped after {written} files", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
