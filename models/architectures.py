"""CPU-sized architectures, small enough to train on a Raspberry Pi.

Each builder is deterministic by seed: the same name and seed give the same
initial weights on every machine (the coordinator's global model starts there).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Architecture:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int


ARCHITECTURES: dict[str, Architecture] = {
    "mnist_cnn": Architecture("mnist_cnn", MnistCNN, (1, 28, 28), 10),
    "mnist_mlp": Architecture("mnist_mlp", MnistMLP, (1, 28, 28), 10),
    "digits_mlp": Architecture("digits_mlp", DigitsMLP, (64,), 10),
    "logreg60": Architecture("logreg60", LogisticRegression, (60,), 10),
}


def build_model(name: str, seed: int = 0) -> nn.Module:
    """A fresh model whose initial weights depend only on (name, seed)."""
    try:
        arch = ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(ARCHITECTURES)}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return arch.build()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def get_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Trainable parameters as float32 numpy arrays, in a stable order."""
    return {name: p.detach().cpu().numpy().astype(np.float32, copy=True) for name, p in model.named_parameters()}


def set_weights(model: nn.Module, weights: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(weights[name], dtype=np.float32)))
