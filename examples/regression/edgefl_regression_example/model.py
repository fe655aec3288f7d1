"""The model the federation trains: `[federation] model = "edgefl_regression_example.model:build"`.

An MLP from the 10 baseline variables of a diabetes patient (standardized, see prepare.py) to one
number: disease progression a year later, in standard deviations from the mean. 385 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES = ("age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6")
HIDDEN = 32


class ProgressionMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_shape = (len(FEATURES),)  # per sample; EdgeFL checks device data against it
        self.net = nn.Sequential(nn.Linear(len(FEATURES), HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (batch, 1): one target per sample


def build() -> ProgressionMLP:
    return ProgressionMLP()
