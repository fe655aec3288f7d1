"""Everything `broker-coordinator simulate` needs for the regression example, in one directory:

    python -m edgefl_regression_example.prepare --out regression-run --devices 4

    regression-run/data/clinic-K.csv      one clinic's patients: 10 feature columns and `progression`
    regression-run/devices/clinic-K.toml  its [data] section: the CSV, the label column, 20% held out

The data is scikit-learn's diabetes set (442 patients, shipped inside the scikit-learn package).
The split is non-IID by age: the patients sorted by age and cut into `--devices` contiguous bands, as
if each clinic served a different age group (the youngest band's mean progression is about 0.4
standard deviations below the oldest's). There is no central test set: each agent holds out 20% of its
rows (edge_agent's hash of file kind and row, the same rows every round) and evaluates the global model
on them. Every column is standardized over all 442 patients (mean 0, standard deviation 1), so the MSE
reads as a fraction of the target's variance: predicting the mean scores about 1.0.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

from .model import FEATURES

LABEL = "progression"
HOLDOUT = 0.2


def load_standardized() -> tuple[np.ndarray, np.ndarray]:
    """x (442, 10) and y (442,), each column standardized; rows in the dataset's order."""
    try:
        from sklearn.datasets import load_diabetes
    except ImportError:
        raise SystemExit("prepare: error: the diabetes data ships with scikit-learn, which is not installed: "
                         "pip install scikit-learn") from None
    bunch = load_diabetes(scaled=False)  # raw units: age in years, bmi, blood pressure, six serum measures
    x, y = bunch.data.astype(np.float64), bunch.target.astype(np.float64)
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


def age_bands(age: np.ndarray, devices: int) -> list[np.ndarray]:
    """Row indices of each clinic: contiguous age bands of (nearly) equal size, youngest first."""
    return np.array_split(np.argsort(age, kind="stable"), devices)


def write_csv(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow([*FEATURES, LABEL])
        for row, target in zip(x, y):
            writer.writerow([f"{v:.6f}" for v in row] + [f"{target:.6f}"])


def data_section(path: Path) -> str:
    """The agent's [data] section (edge_agent/config.py); json.dumps quotes a path as a valid TOML string."""
    return ("[data]\n"
            'source = "csv"\n'
            f"path = {json.dumps(str(path))}\n"
            f'label_column = "{LABEL}"\n'
            f"holdout = {HOLDOUT}        # these rows never train; the device evaluates the global model on them\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgefl_regression_example.prepare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into (created)")
    parser.add_argument("--devices", type=int, default=4, help="clinics, one age band each (2..20)")
    args = parser.parse_args(argv)
    if not 2 <= args.devices <= 20:
        parser.error(f"--devices must be 2..20 (442 patients: at least 22 per clinic), got {args.devices}")
    x, y = load_standardized()
    out = args.out.resolve()
    try:
        (out / "data").mkdir(parents=True, exist_ok=True)
        (out / "devices").mkdir(parents=True, exist_ok=True)
        for k, rows in enumerate(age_bands(x[:, FEATURES.index("age")], args.devices)):
            path = out / "data" / f"clinic-{k}.csv"
            write_csv(path, x[rows], y[rows])
            (out / "devices" / f"clinic-{k}.toml").write_text(data_section(path))
            print(f"clinic-{k}: {len(rows)} patients, mean progression {y[rows].mean():+.2f} sd")
    except OSError as exc:
        print(f"prepare: error: {exc}", file=sys.stderr)
        return 2
    print("then the federation (no central test set: the devices evaluate):")
    print(f"  broker-coordinator simulate --model edgefl_regression_example.model:build --task regression "
          f"--loss mse --devices-dir {out / 'devices'} --evaluate devices --codec float16 --round-timeout 4 "
          f"--rounds 10 --out {out / 'result'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
