"""The local training loop. One loop for every algorithm; read it top to bottom.

Per mini-batch there are at most two forward-backward passes, both visible
below: pass 1 at theta (every algorithm; SAM's ascent gradient), pass 2 at
theta + eps (SAM family only). The algorithm's client rule says whether pass 1
happens this step (CPU-sized SAM reuses an earlier eps), what eps is, and what
to add to the gradient before clipping and the optimizer (proximal pulls,
duals, DR-SAM's folded consistency term).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edgefl_protocol.algorithms.base import ClientRule, Scalar
from edgefl_models.architectures import get_weights
from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective

from .dp_sgd import DeviceDP, noise_generator, per_example_model, private_backward
from .optim import LocalSGD


class Stopped(Exception):
    """Training was interrupted at a step boundary because the agent is shutting down."""


@dataclass
class LocalSettings:
    epochs: int = 2
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 1e-3
    grad_clip: float = 10.0
    dp: DeviceDP | None = None  # [privacy] device = "dp-sgd": each step's data gradient privatized (dp_sgd.py)


@dataclass
class LocalResult:
    delta: dict[str, np.ndarray]  # theta_local - theta_global, plus the rule's "extra.*" tensors
    num_samples: int
    metrics: dict[str, Scalar]


def forward_backward(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach())


def train_locally(model: nn.Module, data: Dataset, rule: ClientRule, settings: LocalSettings,
                  seed: int, should_stop: Callable[[], bool] | None = None,
                  objective: Objective = Objective()) -> LocalResult:
    started = time.perf_counter()
    start_weights = get_weights(model)
    params = [p for p in model.parameters() if p.requires_grad]
    global_params = [p.detach().clone() for p in params]
    optimizer = LocalSGD(params, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    x_all, y_all = torch.from_numpy(data.x), torch.from_numpy(data.y)
    # classification: the rule's loss (cross-entropy, or one that knows the local labels); regression:
    # the error the operator chose
    loss_fn = rule.loss_function(y_all) if objective.task == "classification" else objective.loss_function()
    generator = torch.Generator().manual_seed(seed)
    epochs = rule.local_epochs(settings.epochs)
    steps_per_epoch = math.ceil(len(y_all) / settings.batch_size)
    rule.begin(model, global_params, epochs * steps_per_epoch, len(y_all))
    private = per_example_model(model) if settings.dp else None  # dp-sgd: the same parameters, hooked
    noise = noise_generator() if settings.dp else None

    model.train()
    step, loss_sum, passes = 0, 0.0, 0
    for _epoch in range(epochs):
        order = torch.randperm(len(y_all), generator=generator)
        for start in range(0, len(order), settings.batch_size):
            if should_stop and should_stop():
                raise Stopped()
            batch = order[start:start + settings.batch_size]
            x, y = x_all[batch], y_all[batch]
            loss = None
            if private is not None:                       # dp-sgd: pass 1 clipped per example, noised
                loss = private_backward(private, params, loss_fn, x, y, settings.dp, noise)
                passes += 1
            elif rule.wants_clean_gradient(step):         # pass 1: gradient at theta
                loss = forward_backward(model, loss_fn, x, y)
                passes += 1
            eps = rule.perturbation(step, params, loss)   # SAM family: the ascent step (fresh or reused)
            if eps is not None:                           # pass 2: gradient at theta + eps, then restore
                with torch.no_grad():
                    torch._foreach_add_(params, eps)
                loss_perturbed = forward_backward(model, loss_fn, x, y)
                passes += 1
                with torch.no_grad():
                    torch._foreach_sub_(params, eps)
                rule.observe_perturbed(step, loss, loss_perturbed)
                loss = loss_perturbed if loss is None else loss
            rule.adjust_gradients(step, params)           # regularizers and duals, before clipping
            if settings.grad_clip > 0:
                nn.utils.clip_grad_norm_(params, settings.grad_clip)
            optimizer.step()
            loss_sum += loss
            step += 1

    if private is not None:
        private.remove_hooks()
    end_weights = get_weights(model)
    metrics: dict[str, Scalar] = {
        "train_loss": loss_sum / max(step, 1),
        "epochs": epochs,
        "steps": step,
        "passes": passes,
        "train_seconds": time.perf_counter() - started,
    }
    if settings.dp:
        metrics["dp_sample_rate"] = min(1.0, settings.batch_size / max(len(y_all), 1))
    metrics.update(rule.end(params))
    delta = {name: end_weights[name] - start_weights[name] for name in start_weights}
    delta.update(rule.extra_tensors())
    metrics["train_seconds"] = time.perf_counter() - started
    return LocalResult(delta, len(y_all), metrics)
