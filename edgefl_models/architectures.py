"""CPU-sized architectures, small enough to train on a Raspberry Pi, and the user's own.

A model is named either by a built-in name (`mnist_cnn`, ...) or as
`package.module:factory` from a Python package installed on the coordinator
and on every device (code never travels over MQTT). A factory takes no
arguments and returns a `torch.nn.Module` with an `input_shape` attribute (the
shape of one sample); its outputs are found by one forward pass.

Each builder is deterministic by seed: the same name and seed give the same
initial weights on every machine (the coordinator's global model starts there).
A model's fingerprint (parameter names, shapes, dtypes) travels with every
release, so a device whose installed model differs refuses instead of training it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


class MnistCNN(nn.Module):
    """Conv(1,16,5)-ReLU-Pool-Conv(16,32,5)-ReLU-Pool-FC(512,128)-ReLU-FC(128,10).

    80,202 parameters; input (N, 1, 28, 28). The CNN of the DR-SAM peer
    measurement, so our numbers compare with it one to one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))
        # Channels-last conv weights make torch's CPU kernels run NHWC: on torch 2.13's x86 CPU build, one
        # thread, an evaluation of 1,000 images took 0.13 s instead of 0.24 (max-pooling NCHW is the slow
        # part) and ten training steps at batch 32 0.14 s instead of 0.20. Values and names are unchanged;
        # get_weights hands out C-ordered arrays.
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MnistMLP(nn.Module):
    """FC(784,1024)-ReLU-FC(1024,256)-ReLU-FC(256,10). 1,068,810 parameters; input (N, 1, 28, 28).

    The ~1M-parameter model of the codec benchmark (bench/codec.py).
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                                 nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsMLP(nn.Module):
    """FC(64,64)-ReLU-FC(64,10) for scikit-learn's 8x8 digits. 4,810 parameters; input (N, 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LogisticRegression(nn.Module):
    """Multinomial logistic regression, FC(60,10), for FedProx Synthetic. 610 parameters; input (N, 60)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(60, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class SyntheticMLP(nn.Module):
    """FC(60,256)-ReLU-FC(256,256)-ReLU-FC(256,10) for FedProx Synthetic. 83,978 parameters; input (N, 60).
    The privacy benchmark's model: the noise of DP grows with sqrt(d), so a 610-parameter logistic
    regression would make it look free."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(60, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class Architecture:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int  # outputs per sample: classes, or regression targets


ARCHITECTURES: dict[str, Architecture] = {
    "mnist_cnn": Architecture("mnist_cnn", MnistCNN, (1, 28, 28), 10),
    "mnist_mlp": Architecture("mnist_mlp", MnistMLP, (1, 28, 28), 10),
    "digits_mlp": Architecture("digits_mlp", DigitsMLP, (64,), 10),
    "logreg60": Architecture("logreg60", LogisticRegression, (60,), 10),
    "synthetic_mlp": Architecture("synthetic_mlp", SyntheticMLP, (60,), 10),
}


class ModelError(ValueError):
    """A model name that does not resolve to a usable model here, with what to do about it."""


@functools.lru_cache(maxsize=32)
def resolve(name: str) -> Architecture:
    """The architecture a model name stands for: a built-in, or `package.module:factory`."""
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    if ":" not in name:
        raise ModelError(f"unknown model {name!r}: choose one of {', '.join(ARCHITECTURES)}, "
                         "or name your own as package.module:factory")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"model {name!r}: cannot import {module_name!r} ({exc}); install the package that "
                         "provides it on this machine (pip install ...)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"model {name!r}: {module_name} has no callable {attr!r}")
    model = _call_factory(name, factory)
    shape = getattr(model, "input_shape", None)
    if (not isinstance(shape, (tuple, list)) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ModelError(f"model {name!r}: the module needs an input_shape attribute, the shape of one sample "
                         f"as a tuple of positive ints (e.g. (3, 128)); got {shape!r}")
    try:
        with torch.no_grad():
            output = model.eval()(torch.zeros((2, *shape)))
    except Exception as exc:  # the user's code: say what failed instead of a traceback
        raise ModelError(f"model {name!r}: a forward pass on zeros of shape (2, {', '.join(map(str, shape))}) "
                         f"failed: {exc}") from None
    if not isinstance(output, torch.Tensor) or output.ndim < 1 or output.shape[0] != 2:
        raise ModelError(f"model {name!r}: forward must return a tensor of shape (batch, outputs)")
    return Architecture(name, functools.partial(_call_factory, name, factory), tuple(shape),
                        int(output[0].numel()))


def _call_factory(name: str, factory: Callable[[], nn.Module]) -> nn.Module:
    try:
        model = factory()
    except Exception as exc:
        raise ModelError(f"model {name!r}: the factory failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"model {name!r}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(name: str, seed: int = 0) -> nn.Module:
    """A fresh model whose initial weights depend only on (name, seed)."""
    arch = resolve(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return arch.build()


def fingerprint(model: nn.Module) -> str:
    """sha256 over the trainable parameters' names, shapes and dtypes, in order: two installs of a
    model agree on it exactly when an update from one fits the other."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return digest.hexdigest()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def get_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Trainable parameters as float32 numpy arrays, in a stable order."""
    return {name: p.detach().cpu().numpy().astype(np.float32, order="C", copy=True)
            for name, p in model.named_parameters()}


def set_weights(model: nn.Module, weights: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(weights[name], dtype=np.float32)))
