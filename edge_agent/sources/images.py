"""A folder of images with one sub-folder per class; class index = position of the sub-folder's
name in sorted order. Needs Pillow (`pip install 'edgefl[images]'`)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np

from edge_agent.sources.base import DataError, LocalData, held_out_mask, split
from edgefl_models.datasets import Dataset

log = logging.getLogger("edge_agent.data")


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading an image folder needs Pillow, which is not installed: "
                        "pip install 'edgefl[images]'", "missing_dependency") from None
    return Image


class ImageFolderSource:
    """Read once, on the first `read()`; an unreadable image is skipped with one logged line."""

    def __init__(self, root: Path, size: tuple[int, ...], channels: int, holdout: float) -> None:
        self.root, self.size, self.channels, self.holdout = root, size, channels, holdout
        self.skipped: Counter[str] = Counter()
        self.classes: list[str] = []
        self.data: LocalData | None = None

    def read(self) -> LocalData:
        if self.data is None:
            self.data = self._load()
        return self.data

    def _load(self) -> LocalData:
        image = _pillow()
        if not self.root.is_dir():
            raise DataError(f"image folder {self.root} does not exist ([data] path)", "missing")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise DataError(f"image folder {self.root} has no sub-folders: put each class's images in a "
                            f"sub-folder named after the class", "empty")
        height, width = self.size
        mode = "L" if self.channels == 1 else "RGB"
        xs, ys, keys = [], [], []
        for label, name in enumerate(self.classes):
            for path in sorted((self.root / name).iterdir()):
                if path.name.startswith(".") or not path.is_file():
                    continue
                try:
                    with image.open(path) as picture:
                        pixels = np.asarray(picture.convert(mode).resize((width, height)), dtype=np.float32)
                except Exception as exc:  # Pillow raises many types for a broken file; none may stop the agent
                    self.skipped["unreadable"] += 1
                    log.warning("image folder %s: skipped %s (unreadable): %s", self.root, path, exc)
                    continue
                xs.append(pixels.reshape(height, width, self.channels).transpose(2, 0, 1) / 255.0)
                ys.append(label)
                keys.append(f"{name}/{path.name}")
        if not xs:
            raise DataError(f"image folder {self.root}: no readable images in {len(self.classes)} class folders",
                            "empty")
        data = Dataset(np.stack(xs).astype(np.float32), np.asarray(ys, dtype=np.int64))
        mask = np.array([held_out_mask(key, 0, 1, self.holdout)[0] for key in keys], dtype=bool)
        return split(data, mask)

    def describe(self) -> str:
        if self.data is None:
            return f"images {self.root}: not read yet"
        n = len(self.data.train) + len(self.data.held_out)
        return (f"images {self.root}: {n:,} images in {len(self.classes)} classes, {len(self.data.held_out):,} held "
                f"out, {sum(self.skipped.values())} unreadable")
