"""One `.npz` or `.csv` file into checked samples, for the fixed-file sources and the spool alike.

Every problem is a DataError whose message names the file and what is wrong
(for a CSV also the line and column) and whose `reason` keys the counters.
"""

from __future__ import annotations

import csv
import math
import zipfile
from pathlib import Path

import numpy as np

from edge_agent.sources.base import DataError
from edgefl_models.datasets import Dataset

MAX_FILE_BYTES = 256 << 20  # a bigger file (or npz members that inflate past it) is refused, not loaded


def check_samples(x: np.ndarray, y: np.ndarray, task: str, where: str) -> Dataset:
    """x numeric (N, ...) and finite; y (N,) integer labels >= 0 (classification) or numeric (N,) / (N, k)."""
    if x.dtype.kind not in "fiu":
        raise DataError(f"{where}: x has dtype {x.dtype}; it must hold numbers", "wrong_dtype")
    if x.ndim < 2 or len(x) != len(y):
        raise DataError(f"{where}: x must be (N, ...) and y (N,) with the same N, got {x.shape} and {y.shape}",
                        "wrong_shape")
    if len(y) == 0:
        raise DataError(f"{where}: holds no samples", "empty")
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    if bad.any():
        raise DataError(f"{where}: x has NaN or inf in {int(bad.sum())} samples (first: sample {int(bad.argmax())})",
                        "not_finite")
    if task == "classification":
        if y.dtype.kind not in "iu":
            raise DataError(f"{where}: y has dtype {y.dtype}; classification needs integer class labels",
                            "label_type")
        if y.ndim != 1:
            raise DataError(f"{where}: y must be (N,) class labels, got shape {y.shape}", "wrong_shape")
        if (y < 0).any():
            raise DataError(f"{where}: y has negative class labels (smallest {int(y.min())})", "bad_label")
        return Dataset(x.astype(np.float32, copy=False), y.astype(np.int64, copy=False))
    if y.dtype.kind not in "fiu":
        raise DataError(f"{where}: y has dtype {y.dtype}; regression needs numeric targets", "label_type")
    if y.ndim not in (1, 2):
        raise DataError(f"{where}: y must be (N,) or (N, k) targets, got shape {y.shape}", "wrong_shape")
    if not np.isfinite(y).all():
        raise DataError(f"{where}: y has NaN or inf targets", "not_finite")
    return Dataset(x.astype(np.float32, copy=False), y.astype(np.float32, copy=False))


def reshape_rows(x: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Flat feature rows (N, F) into (N, *shape); `shape` () leaves them flat."""
    if not shape or x.shape[1:] == shape:
        return x
    if x.ndim != 2 or x.shape[1] != math.prod(shape):
        raise DataError(f"{where}: samples of shape {x.shape[1:]} cannot be reshaped to [data] shape = "
                        f"{list(shape)} ({math.prod(shape)} values each)", "wrong_shape")
    return x.reshape(len(x), *shape)


def read_npz(path: Path, task: str, shape: tuple[int, ...] = ()) -> Dataset:
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise DataError(f"{path}: not an .npz archive (expected arrays x and y)", "unreadable")
            missing = {"x", "y"} - set(archive.files)
            if missing:
                raise DataError(f"{path}: no array {' or '.join(sorted(missing))} (expected arrays x and y, "
                                f"found {', '.join(archive.files) or 'none'})", "wrong_shape")
            inflated = sum(info.file_size for info in archive.zip.infolist())
            if inflated > MAX_FILE_BYTES:
                raise DataError(f"{path}: arrays of {inflated >> 20} MB exceed the {MAX_FILE_BYTES >> 20} MB limit "
                                f"per file", "oversized")
            x, y = archive["x"], archive["y"]
    except FileNotFoundError:
        raise DataError(f"{path} does not exist", "missing") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: cannot read it as an .npz ({type(exc).__name__}: {exc}); a truncated or "
                        f"half-written file?", "unreadable") from None
    return check_samples(reshape_rows(x, shape, str(path)), y, task, str(path))


def _bad_cell(rows: list[list[str]], columns: list[str], first_line: int) -> str:
    """Where the first non-number is, for a person to fix it."""
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            try:
                float(cell)
            except ValueError:
                return f"line {first_line + r}, column {columns[c]!r}: {cell!r} is not a number"
    return "a cell is not a number"


def read_csv(path: Path, task: str, label_column: str, shape: tuple[int, ...] = ()) -> Dataset:
    """A header row, then one sample per line: the label column by name, every other column a feature."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            lines = list(csv.reader(handle))
    except FileNotFoundError:
        raise DataError(f"{path} does not exist", "missing") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read it as CSV ({exc})", "unreadable") from None
    if not lines:
        raise DataError(f"{path}: empty file (expected a header row, then one sample per line)", "empty")
    header, rows = [name.strip() for name in lines[0]], [row for row in lines[1:] if row]
    if label_column not in header:
        raise DataError(f"{path}: no column {label_column!r} (columns: {', '.join(header)}); "
                        f"set [data] label_column to the column that holds the labels", "missing_label_column")
    for number, row in enumerate(lines[1:], start=2):
        if row and len(row) != len(header):
            raise DataError(f"{path}: line {number} has {len(row)} cells, the header has {len(header)}",
                            "wrong_shape")
    label = header.index(label_column)
    features = [name for name in header if name != label_column]
    if not rows:
        raise DataError(f"{path}: a header but no samples", "empty")
    cells = np.array(rows, dtype=str)
    feature_cells = np.delete(cells, label, axis=1)
    try:
        x = feature_cells.astype(np.float32)
    except ValueError:
        raise DataError(f"{path}: {_bad_cell(feature_cells.tolist(), features, 2)}", "not_numeric") from None
    y = _labels(path, cells[:, label], label_column, task)
    return check_samples(reshape_rows(x, shape, str(path)), y, task, str(path))


def _labels(path: Path, cells: np.ndarray, column: str, task: str) -> np.ndarray:
    try:
        return cells.astype(np.int64) if task == "classification" else cells.astype(np.float32)
    except ValueError:
        pass
    kind = "an integer class label" if task == "classification" else "a number"
    for line, cell in enumerate(cells.tolist(), start=2):
        try:
            int(cell) if task == "classification" else float(cell)
        except ValueError:
            raise DataError(f"{path}: line {line}, column {column!r}: {cell!r} is not {kind}",
                            "label_type") from None
    raise DataError(f"{path}: column {column!r} does not hold {kind} on every line", "label_type")


def read_file(path: Path, task: str, label_column: str, shape: tuple[int, ...] = ()) -> Dataset:
    """By suffix: `.csv`, else `.npz`."""
    if path.suffix.lower() == ".csv":
        return read_csv(path, task, label_column, shape)
    return read_npz(path, task, shape)
