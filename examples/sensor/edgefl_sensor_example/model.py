"""The model the federation trains: `[federation] model = "edgefl_sensor_example.model:build"`.

A 1-D CNN over 8-second windows of a smartwatch's 3-axis accelerometer and
3-axis gyroscope (6 channels x 80 samples at 10 Hz), four activities out.
3,220 parameters: a round's update is a few KB even before the codec.
"""

from __future__ import annotations

import torch
from torch import nn

from .basicmotions import CHANNELS, CLASSES, WINDOW  # the data's shape (numpy only)


class MotionCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_shape = (CHANNELS, WINDOW)  # per sample; EdgeFL checks device data against it
        self.features = nn.Sequential(
            nn.Conv1d(CHANNELS, 16, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(16, 32, kernel_size=5, padding=2), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),  # average over time: where in the window a stride falls does not matter
        )
        self.classify = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x).flatten(1))


def build() -> MotionCNN:
    return MotionCNN()
