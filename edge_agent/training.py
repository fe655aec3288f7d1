"""The local training loop. One loop for every algorithm; read it top to bottom.

The algorithm's client rule decides how gradients are computed for a batch
(SAM-family rules do their extra pass inside `compute_gradients`) and what is
added to them before the optimizer sees them (`adjust_gradients`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edgefl_protocol.algorithms.base import ClientRule, Scalar
from models.architectures import get_weights

from .optim import LocalSGD
from models.datasets import Dataset


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


@dataclass
class LocalResult:
    delta: dict[str, np.ndarray]  # theta_local - theta_global
    num_samples: int
    metrics: dict[str, Scalar]


def train_locally(model: nn.Module, data: Dataset, rule: ClientRule, settings: LocalSettings,
                  seed: int, should_stop: Callable[[], bool] | None = None) -> LocalResult:
    started = time.perf_counter()
    start_weights = get_weights(model)
    params = [p for p in model.parameters() if p.requires_grad]
    global_params = [p.detach().clone() for p in params]
    optimizer = LocalSGD(params, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    x_all, y_all = torch.from_numpy(data.x), torch.from_numpy(data.y)
    generator = torch.Generator().manual_seed(seed)
    rule.begin(model, global_params)

    model.train()
    steps, loss_sum = 0, 0.0
    for _epoch in range(settings.epochs):
        order = torch.randperm(len(y_all), generator=generator)
        for start in range(0, len(order), settings.batch_size):
            if should_stop and should_stop():
                raise Stopped()
            batch = order[start:start + settings.batch_size]
            optimizer.zero_grad()
            loss_sum += rule.compute_gradients(model, loss_fn, x_all[batch], y_all[batch])
            rule.adjust_gradients(params)
            if settings.grad_clip > 0:
                nn.utils.clip_grad_norm_(params, settings.grad_clip)
            optimizer.step()
            steps += 1

    end_weights = get_weights(model)
    metrics: dict[str, Scalar] = {
        "train_loss": loss_sum / max(steps, 1),
        "epochs": settings.epochs,
        "steps": steps,
        "train_seconds": time.perf_counter() - started,
    }
    metrics.update(rule.end(model))
    delta = {name: end_weights[name] - start_weights[name] for name in start_weights}
    return LocalResult(delta, len(y_all), metrics)
