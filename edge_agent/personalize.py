"""Personalized serving (opt-in, `[serving] personalize`): a copy of each release made to fit this
device before the gate judges it. The training model is untouched; the gate then serves whichever of
the personalized and the released model does better on the device's held-out data, if it is not
worse than the current version (serving_gate.py).

- "prior": the device's own label frequencies added to the model's output as log-priors (the copy's
  last bias moved by log p_device(c) - log 1/K, with add-half smoothing so that no class is ruled
  out). No training: it corrects for the label shift between the fleet and this device, which is
  most of what separates them under skewed data. Classification models whose last layer has a bias
  per class; another model is served as released (said once at INFO).
- "tune": `personalize_steps` SGD steps of the whole copy on the device's training data.

Measured on the headline partition: bench/results/serving.md.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective

MODES = ("off", "prior", "tune")
BATCH = 32
SMOOTHING = 0.5  # add-half: a class the device has not seen yet keeps a finite prior


def personalize(model: torch.nn.Module, train: Dataset, objective: Objective, mode: str, steps: int, lr: float,
                seed: int = 0) -> torch.nn.Module | None:
    """A personalized copy of `model` (eval mode), or None when `mode` cannot apply to it; `model`
    itself is not changed."""
    if mode == "prior":
        return with_label_prior(model, train, objective)
    if mode == "tune":
        return tuned(model, train, objective, steps, lr, seed)
    return None


def with_label_prior(model: torch.nn.Module, train: Dataset, objective: Objective) -> torch.nn.Module | None:
    if objective.task != "classification":
        return None
    copied = copy.deepcopy(model)
    bias = _class_bias(copied)
    if bias is None:
        return None
    classes = bias.numel()
    counts = np.bincount(np.asarray(train.y, dtype=np.int64), minlength=classes)[:classes].astype(np.float64)
    prior = (counts + SMOOTHING) / (counts.sum() + SMOOTHING * classes)
    with torch.no_grad():
        bias.add_(torch.as_tensor(np.log(prior * classes), dtype=bias.dtype))
    return copied.eval()


def _class_bias(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The bias of the last Linear layer: one value per class, added to the logits."""
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return last[-1].bias if last and last[-1].bias is not None else None


def tuned(model: torch.nn.Module, train: Dataset, objective: Objective, steps: int, lr: float,
          seed: int = 0) -> torch.nn.Module:
    copied = copy.deepcopy(model)
    copied.train()
    loss_fn = objective.loss_function()
    optimizer = torch.optim.SGD(copied.parameters(), lr=lr, momentum=0.9)
    rng = np.random.default_rng(seed)
    x_all = torch.as_tensor(train.x)
    y_all = torch.as_tensor(train.y.astype(objective.label_dtype()))
    for _ in range(steps):
        batch = torch.as_tensor(rng.choice(len(train), size=min(BATCH, len(train)), replace=False))
        optimizer.zero_grad()
        loss_fn(copied(x_all[batch]), y_all[batch]).backward()
        optimizer.step()
    return copied.eval()
