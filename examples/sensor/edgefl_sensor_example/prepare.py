"""Everything `broker-coordinator simulate` needs for the sensor example, in one directory:

    python -m edgefl_sensor_example.prepare --out sensor-run --devices 4

    sensor-run/devices/watch-K.toml   each device's [data] section: its spool, the window it keeps
    sensor-run/spool/watch-K/         where generator K writes (created empty)
    sensor-run/test.npz               the coordinator's test set: the 40 BasicMotions test recordings,
                                      their middle 8 s (no device ever sees them)

It prints the generator and simulate commands to run next.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from . import basicmotions

WINDOW_SAMPLES = 256  # windows an agent keeps: the newest ~8 s of its stream at the generator's defaults


def device_name(k: int) -> str:
    return f"watch-{k}"


def data_section(spool: Path, window: int) -> str:
    """The agent's [data] section (edge_agent/config.py); json.dumps quotes a path as a valid TOML string."""
    return ("[data]\n"
            'source = "spool"\n'
            f"path = {json.dumps(str(spool))}\n"
            f"window = {window}\n"
            "holdout = 0.0        # evaluation is central, on test recordings no device has\n"
            'consume = "delete"   # a file is deleted once its windows leave the window: the disk holds no history\n')


def write_test_set(path: Path) -> tuple[int, list[int]]:
    x, y = basicmotions.load("test")
    np.savez(path, x=basicmotions.centre_windows(x), y=y)
    return len(y), np.bincount(y, minlength=len(basicmotions.ACTIVITIES)).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgefl_sensor_example.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into (created)")
    parser.add_argument("--devices", type=int, default=4, help="devices (>= 4: each sees 2 of the 4 activities)")
    parser.add_argument("--window", type=int, default=WINDOW_SAMPLES, help="windows each agent keeps in memory")
    args = parser.parse_args(argv)
    if args.devices < 4:
        parser.error(f"--devices must be >= 4 (each device sees 2 of the 4 activities), got {args.devices}")
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    out = args.out.resolve()
    try:
        (out / "devices").mkdir(parents=True, exist_ok=True)
        for k in range(args.devices):
            spool = out / "spool" / device_name(k)
            spool.mkdir(parents=True, exist_ok=True)
            (out / "devices" / f"{device_name(k)}.toml").write_text(data_section(spool, args.window))
        count, per_class = write_test_set(out / "test.npz")
    except (basicmotions.DataMissing, OSError) as exc:
        print(f"prepare: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.devices} device configs into {out / 'devices'} and {count} test windows "
          f"({', '.join(f'{a} {n}' for a, n in zip(basicmotions.ACTIVITIES, per_class))}) into {out / 'test.npz'}")
    print("next, one generator per device (leave them running):")
    for k in range(args.devices):
        print(f"  python -m edgefl_sensor_example.generator --spool {out / 'spool' / device_name(k)} "
              f"--device {k} --devices {args.devices} &")
    print("then the federation:")
    print(f"  broker-coordinator simulate --model edgefl_sensor_example.model:build --task classification "
          f"--devices-dir {out / 'devices'} --test-data {out / 'test.npz'} --rounds 10 --round-timeout 6 --out {out / 'result'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
