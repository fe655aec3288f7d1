"""Personalized serving (opt-in, `[serving] personalize`): a copy of each release made to fit this
device before the gate judges it. The training model is untouched; the gate then serves whichever of
the personalized and the released model does better on the device's held-out data, if it is not
worse than the current version (serving_gate.py).

- "prior": the device's own label frequencies added to the model's output as log-priors (the copy's
  last bias moved by s * (log p_device(c) - log 1/K), with add-half smoothing so that no class is
  ruled out). No training: it corrects for the label shift between the fleet and this device, which
  is most of what separates them under skewed data. The strength s is fitted on the device's own
  training data (the one of PRIOR_STRENGTHS with the least cross-entropy there): a model averaged
  over a fleet is less confident than Bayes' rule assumes (s = 1), by an amount that changes with
  training, so a fixed strength is too strong early and too weak late. Classification models whose
  last layer has a bias per class; another model is served as released (said once at INFO).
- "tune": `personalize_steps` SGD steps of the whole copy on the device's training data.

Measured on the headline partition: bench/results/serving.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch

from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective

MODES = ("off", "prior", "tune")
BATCH = 32
SMOOTHING = 0.5  # add-half: a class the device has not seen yet keeps a finite prior
# 0 = the release as it is (the strengths the devices fitted at round 40: bench/results/serving.md)
PRIOR_STRENGTHS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
FIT_SAMPLES = 2048  # enough to fit one number; bounds the memory of one forward pass on a Pi


@dataclass
class Personalized:
    model: torch.nn.Module  # eval mode
    detail: dict = field(default_factory=dict)  # for the store's metadata.json: how it was made


def personalize(model: torch.nn.Module, train: Dataset, objective: Objective, mode: str, steps: int, lr: float,
                seed: int = 0) -> Personalized | None:
    """A personalized copy of `model`, or None when `mode` cannot apply to it; `model` itself is not
    changed."""
    if mode == "prior":
        return with_label_prior(model, train, objective)
    if mode == "tune":
        return Personalized(tuned(model, train, objective, steps, lr, seed), {"steps": steps})
    return None


def with_label_prior(model: torch.nn.Module, train: Dataset, objective: Objective,
                     strength: float | None = None) -> Personalized | None:
    """The copy with the device's label prior at `strength` (None: fitted on the training data)."""
    if objective.task != "classification":
        return None
    copied = copy.deepcopy(model)
    bias = _class_bias(copied)
    if bias is None:
        return None
    classes = bias.numel()
    labels = np.asarray(train.y, dtype=np.int64)
    counts = np.bincount(labels, minlength=classes)[:classes].astype(np.float64)
    prior = (counts + SMOOTHING) / (counts.sum() + SMOOTHING * classes)
    log_prior = torch.as_tensor(np.log(prior * classes), dtype=bias.dtype)
    strength = fitted_strength(copied, train, log_prior) if strength is None else strength
    with torch.no_grad():
        bias.add_(strength * log_prior)
    return Personalized(copied.eval(), {"strength": strength})


def fitted_strength(model: torch.nn.Module, train: Dataset, log_prior: torch.Tensor) -> float:
    """The prior strength with the least cross-entropy on the device's training data (ties: the weaker)."""
    labels = torch.as_tensor(np.asarray(train.y[:FIT_SAMPLES], dtype=np.int64))
    model.eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(train.x[:FIT_SAMPLES])).double()
    if logits.ndim != 2 or logits.shape[1] != log_prior.numel() or int(labels.min()) < 0 \
            or int(labels.max()) >= log_prior.numel():
        return 1.0  # not one logit per label: Bayes' rule as it is
    lp = log_prior.double()
    losses = [float(torch.nn.functional.cross_entropy(logits + s * lp, labels)) for s in PRIOR_STRENGTHS]
    return PRIOR_STRENGTHS[int(np.argmin(losses))]


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
