"""Where a device's local data comes from (interim: `.npz` only; CSV, image folders and spool
directories follow). `read()` once per round gives the training data and the held-out slice
for federated evaluation; `check_fits` says, before training, whether the data fits the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from models.datasets import Dataset, DatasetError, load_npz


class DataError(DatasetError):
    """A data source that cannot be read, with what to do about it."""


class DataMismatch(DataError, ValueError):
    """Local data that does not fit the model or the task."""


@dataclass
class DataSettings:
    source: str = "npz"
    path: str = ""
    holdout: float = 0.0

    def validate(self) -> None:
        if self.source != "npz":
            raise ValueError(f"source must be npz, got {self.source!r}")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")


@dataclass
class LocalData:
    train: Dataset
    held_out: Dataset


class DataSource(Protocol):
    def read(self) -> LocalData: ...
    def describe(self) -> str: ...


class NpzSource:
    def __init__(self, settings: DataSettings, task: str) -> None:
        self.settings, self.task = settings, task

    def read(self) -> LocalData:
        data = load_npz(self.settings.path, self.task)
        held = np.zeros(len(data), dtype=bool)
        if self.settings.holdout > 0:  # every k-th sample: stable, so a held-out sample never trains
            held[:: max(1, round(1 / self.settings.holdout))] = True
        return LocalData(data.subset(np.flatnonzero(~held)), data.subset(np.flatnonzero(held)))

    def describe(self) -> str:
        return f"npz {self.settings.path}"


def open_source(settings: DataSettings, task: str) -> DataSource:
    return NpzSource(settings, task)


def check_fits(data: Dataset, input_shape: tuple[int, ...], task: str, outputs: int) -> None:
    if tuple(data.x.shape[1:]) != tuple(input_shape):
        raise DataMismatch(f"local data x has samples of shape {tuple(data.x.shape[1:])} but the model expects "
                           f"{tuple(input_shape)}")
    if task == "classification":
        if not np.issubdtype(data.y.dtype, np.integer) or (len(data.y) and not 0 <= data.y.min() <= data.y.max() < outputs):
            raise DataMismatch(f"local labels must be integers in [0, {outputs}) for this classifier")
    elif not np.issubdtype(data.y.dtype, np.floating):
        raise DataMismatch("local targets must be floats for a regression task")
