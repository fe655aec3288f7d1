"""What every data source shares: its errors, what it returns, and the stable holdout draw."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgefl_models.datasets import Dataset, DatasetError

TASKS = ("classification", "regression")


class DataError(DatasetError):
    """A source that cannot give data (missing, unreadable, broken, empty), with what to do about it.

    `reason` is a short key for counters ("not_finite", "wrong_shape", ...)."""

    def __init__(self, message: str, reason: str = "unreadable") -> None:
        super().__init__(message)
        self.reason = reason


class DataMismatch(DataError, ValueError):
    """Readable data that does not fit the model (shape, label type or range)."""

    def __init__(self, message: str, reason: str = "mismatch") -> None:
        super().__init__(message, reason)


@dataclass
class LocalData:
    train: Dataset
    held_out: Dataset  # for federated evaluation; never trained on (empty when holdout = 0)


class DataSource(Protocol):
    skipped: Counter[str]  # reason -> files skipped (spool, image folder); logged once each

    def read(self) -> LocalData: ...

    def describe(self) -> str: ...


def empty_like(data: Dataset) -> Dataset:
    return Dataset(data.x[:0], data.y[:0])


def held_out_mask(key: str, start: int, rows: int, fraction: float) -> np.ndarray:
    """Which of rows start..start+rows-1 of `key` are held out: a hash of (key, row), so the
    same sample is held out in every round and after restarts, whatever else arrives."""
    if fraction <= 0.0 or rows == 0:
        return np.zeros(rows, dtype=bool)
    seed = np.uint64(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))
    with np.errstate(over="ignore"):  # splitmix64's finalizer: wrap-around multiplication is the point
        z = np.arange(start, start + rows, dtype=np.uint64) + seed
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def split(data: Dataset, mask: np.ndarray) -> LocalData:
    return LocalData(data.subset(~mask), data.subset(mask))
