"""Personalized serving (opt-in, `[serving] personalize_steps`): a few SGD steps of the released
model on the device's own training data, on a copy, before the gate judges it. The training model
is untouched; the gate then serves whichever of the personalized and the released model does better
on the device's held-out data, if it is not worse than the current version (serving_gate.py)."""

from __future__ import annotations

import copy

import numpy as np
import torch

from models.datasets import Dataset
from models.objectives import Objective

BATCH = 32


def personalize(model: torch.nn.Module, train: Dataset, objective: Objective, steps: int, lr: float,
                seed: int = 0) -> torch.nn.Module:
    """A fine-tuned copy of `model` (eval mode); `model` itself is not changed."""
    tuned = copy.deepcopy(model)
    tuned.train()
    loss_fn = objective.loss_function()
    optimizer = torch.optim.SGD(tuned.parameters(), lr=lr, momentum=0.9)
    rng = np.random.default_rng(seed)
    x_all = torch.as_tensor(train.x)
    y_all = torch.as_tensor(train.y.astype(objective.label_dtype()))
    for _ in range(steps):
        batch = torch.as_tensor(rng.choice(len(train), size=min(BATCH, len(train)), replace=False))
        optimizer.zero_grad()
        loss_fn(tuned(x_all[batch]), y_all[batch]).backward()
        optimizer.step()
    return tuned.eval()
