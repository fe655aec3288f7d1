"""docs/DATA.md's recipes run as written, and what they write trains the model they name."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np

from edgefl_models.architectures import resolve
from edgefl_models.datasets import load_npz

from .operator_fixtures import PROJECT_ROOT

GUIDE = PROJECT_ROOT / "docs" / "DATA.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def run(code: str, cwd) -> None:  # noqa: ANN001 - a path
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(PROJECT_ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_image_recipe_writes_what_the_mnist_models_take(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    for label in (3, 7):
        (tmp_path / "images" / str(label)).mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 256, size=(32, 32), dtype=np.uint8)  # another size: the recipe resizes
            Image.fromarray(pixels).save(tmp_path / "images" / str(label) / f"{i}.png")
    run(blocks()[0], tmp_path)
    data = load_npz(tmp_path / "data.npz")
    assert data.x.shape == (8, *resolve("mnist_cnn").input_shape) and sorted(set(data.y.tolist())) == [3, 7]
    assert -0.5 < float(data.x.min()) and float(data.x.max()) < 3.0  # MNIST's scaling: (v/255 - 0.1307) / 0.3081


def test_the_shares_recipe_writes_ten_devices_and_a_test_set(tmp_path):
    run(blocks()[1], tmp_path)
    shares = [load_npz(tmp_path / f"device-{i}.npz") for i in range(10)]
    assert all(s.x.shape[1:] == resolve("digits_mlp").input_shape for s in shares)
    assert load_npz(tmp_path / "test.npz").x.shape[1:] == (64,)
