"""Where a device's training data comes from ([data] in the agent's config), and whether it fits the model.

    source = open_source(config.data, task)   # task: "classification" | "regression"
    local = source.read()                     # once a round: LocalData(train, held_out)
    check_fits(local.train, input_shape, task, outputs, model=name, where=config.data.path)

Sources: "npz" (arrays x and y), "csv" (a header row; the label column by
name, every other column a numeric feature), "images" (one sub-folder per
class, needs Pillow) and "spool" (a directory the device's application keeps
writing batches to; edge_agent/sources/spool.py). A source that cannot give
data raises DataError with what to do; a broken file inside a spool or image
folder is skipped with one logged line and counted in `source.skipped`.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from edge_agent.config import DataSettings
from edge_agent.sources.base import (TASKS, DataError, DataMismatch, DataSource, LocalData, held_out_mask,
                                     split)
from edge_agent.sources.files import read_csv, read_npz
from edge_agent.sources.images import ImageFolderSource
from edge_agent.sources.spool import SpoolSource
from edgefl_models.datasets import Dataset

__all__ = ["DataError", "DataMismatch", "DataSource", "LocalData", "check_fits", "open_source"]


class FileSource:
    """One `.npz` or `.csv` file, read on the first `read()` (and again after a failure, once fixed)."""

    def __init__(self, kind: str, path: Path, load: Callable[[], Dataset], holdout: float) -> None:
        self.kind, self.path, self.load, self.holdout = kind, path, load, holdout
        self.skipped: Counter[str] = Counter()  # stays empty: a broken fixed file is an error, not a skip
        self.data: LocalData | None = None

    def read(self) -> LocalData:
        if self.data is None:
            data = self.load()
            local = split(data, held_out_mask(self.kind, 0, len(data), self.holdout))
            if len(local.train) == 0:
                raise DataError(f"{self.path}: all {len(data)} samples are held out; lower [data] holdout", "empty")
            self.data = local
        return self.data

    def describe(self) -> str:
        if self.data is None:
            return f"{self.kind} {self.path}: not read yet"
        return (f"{self.kind} {self.path}: {len(self.data.train):,} training samples, "
                f"{len(self.data.held_out):,} held out")


def open_source(settings: DataSettings, task: str) -> DataSource:
    """The configured source; nothing is read until `read()`."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    path = Path(settings.path)
    if settings.source == "npz":
        return FileSource("npz", path, lambda: read_npz(path, task, settings.shape), settings.holdout)
    if settings.source == "csv":
        return FileSource("csv", path, lambda: read_csv(path, task, settings.label_column, settings.shape),
                          settings.holdout)
    if settings.source == "images":
        if task != "classification":
            raise DataError(f"[data] source = \"images\" gives class labels; it cannot feed a {task} model",
                            "mismatch")
        return ImageFolderSource(path, settings.image_size, settings.channels, settings.holdout)
    if settings.source == "spool":
        return SpoolSource(path, task, window=settings.window, holdout=settings.holdout, consume=settings.consume,
                           label_column=settings.label_column, shape=settings.shape,
                           state_dir=Path(settings.state_dir) if settings.state_dir else None)
    raise DataError(f"unknown [data] source {settings.source!r}; choose npz, csv, images or spool", "config")


def check_fits(data: Dataset, input_shape: tuple[int, ...], task: str, outputs: int, *,
               model: str = "the model", where: str = "") -> None:
    """Raise DataMismatch (one line: what differs and what to change) unless `data` can train `model`."""
    fix = f": fix the files under {where}" if where else ""
    got, want = tuple(data.x.shape[1:]), tuple(input_shape)
    if got != want:
        hint = ""
        if math.prod(got) == math.prod(want):
            hint = (f" (as many values: set [data] shape = {list(want)})" if len(got) == 1 or sorted(got) != sorted(want)
                    else " (the same axes in another order: transpose the samples)")
        raise DataMismatch(f"local data x has samples of shape {got} but model {model} expects {want}{hint}{fix}",
                           "wrong_shape")
    if data.x.dtype.kind != "f" or not np.isfinite(data.x).all():
        raise DataMismatch(f"local data x must be finite floats, got dtype {data.x.dtype} with "
                           f"{int((~np.isfinite(data.x.astype(np.float64))).sum())} NaN/inf values{fix}", "not_finite")
    y = data.y
    if task == "classification":
        if y.dtype.kind not in "iu" or y.ndim != 1:
            raise DataMismatch(f"local data y is {y.dtype} of shape {y.shape[1:]} per sample, but model {model} "
                               f"classifies: it needs one integer label 0..{outputs - 1} per sample{fix}", "label_type")
        out = (y < 0) | (y >= outputs)
        if out.any():
            raise DataMismatch(f"local data has labels {int(y.min())}..{int(y.max())} but model {model} has {outputs} "
                               f"classes (0..{outputs - 1}); {int(out.sum())} samples are out of range{fix}",
                               "bad_label")
        return
    if task != "regression":
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    shapes = [(outputs,), ()] if outputs == 1 else [(outputs,)]
    if y.dtype.kind != "f":
        raise DataMismatch(f"local data y has dtype {y.dtype}, but model {model} is a regression: it needs float "
                           f"targets (integer class labels? set the task to classification){fix}", "label_type")
    if y.shape[1:] not in shapes:
        raise DataMismatch(f"local data y has targets of shape {y.shape[1:]} but model {model} predicts "
                           f"{outputs} value{'s' if outputs > 1 else ''} per sample{fix}", "wrong_shape")
    if not np.isfinite(y).all():
        raise DataMismatch(f"local data y has {int((~np.isfinite(y)).sum())} NaN/inf targets{fix}", "not_finite")
