"""A device's step: the task in, the signed update out.

The MQTT agent (`agent.Agent`) and the in-memory benchmark driver (`bench/inmemory.py`) both run
`device_step`, so a benchmark measures the code a device runs. What differs between them is a
parameter, not a copy: the data, the seed of the local shuffling, the generator of the codec's
stochastic rounding, the budget the epochs are planned against, the metrics the transport adds, and
for attack benchmarks a `tamper` hook on what is sent.

Top to bottom:

1. the task's training settings, range-checked (`local_settings`); when the task says
   `local_epochs = 0` the device plans them from its speed and the time it has (`hardware.plan_epochs`);
2. the algorithm's client rule, from the device's state and what the server broadcast and released;
3. local training (`training.train_locally`); DP-SGD's spend booked in the device's ledger;
4. the delta encoded with the task's codec and the device's error-feedback residual;
5. the update signed with the device's key.

Nothing the server mirrors is committed here: the device commits what the coordinator folded, once
its verdict is known (`settlement`, from the returned `Sent`).
"""

from __future__ import annotations

import copy
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgefl_protocol import algorithms, codec, messages
from edgefl_protocol.algorithms.base import Scalar
from edgefl_protocol.errors import Rejected
from edgefl_protocol.task_limits import check_training
from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective

from . import dp_sgd
from .hardware import plan_epochs
from .settlement import Sent
from .training import LocalResult, LocalSettings, train_locally

# (delta, num_samples) -> (delta, num_samples): what a malicious device sends instead (attack benchmarks)
Tamper = Callable[[dict[str, np.ndarray], int], tuple[dict[str, np.ndarray], int]]


def local_settings(hp: Mapping[str, Any]) -> LocalSettings:
    """The task's training settings, range-checked (edgefl_protocol.task_limits): a hostile task is
    refused, not obeyed."""
    v = check_training(hp)
    dp = dp_sgd.from_task(hp)
    if dp is not None and (why := dp_sgd.unavailable()):
        raise Rejected(dp_sgd.UNAVAILABLE, why)
    return LocalSettings(epochs=int(v["local_epochs"]), batch_size=int(v["batch_size"]), lr=v["lr"],
                         momentum=v["momentum"], weight_decay=v["weight_decay"], grad_clip=v["grad_clip"], dp=dp)


def agent_seed(device: str, round_no: int) -> int:
    """The seed of an agent's local shuffling: the device and the round."""
    return zlib.crc32(f"{device}/{round_no}".encode())


@dataclass
class Budget:
    """What the epochs are planned against when the task leaves them to the device."""

    speed: Callable[[], float]  # training samples/s of this model here; asked only when planning (it may calibrate)
    seconds: float  # time left for training when the budget was made
    clock: Callable[[], float] = time.monotonic  # a calibration inside `speed` spends the round's own seconds


@dataclass
class Step:
    sent: Sent  # the signed update, and what settling it needs
    result: LocalResult  # as training left it (before any tamper); its metrics are those the update reported
    epochs: int
    epochs_reason: str

    @property
    def payload(self) -> bytes:
        """The signed update, as published."""
        return self.sent.payload


def device_step(task: messages.Task, model: torch.nn.Module, train: Dataset, state: dict[str, Any], *,
                device: str, federation: str, key: bytes, seed: int, budget: Budget,
                released: Mapping[str, np.ndarray] | None = None, rounding: np.random.Generator | None = None,
                report: Mapping[str, Scalar] | None = None, down: Mapping[str, int] | None = None,
                tamper: Tamper | None = None, should_stop: Callable[[], bool] | None = None) -> Step:
    """Train `model` (holding the task's model version) on `train` for `task`, and sign the update.

    `state`: the device's persisted state: the algorithm's section (the client rule works on it;
    `settlement` then sets it to what the verdict commits, or back to `Sent.before`), the codec's
    residual and owed claims (read), the DP-SGD ledger (spent whatever the verdict). `seed`: the local shuffling's (`agent_seed` on a device);
    `budget`: see `Budget`; `released`: the `extra.*` tensors the server rule released with the model;
    `rounding`: the codec's stochastic rounding (None: drawn from the OS); `report`: metrics the
    caller adds (evaluation, model provenance); `down`: the downlink bytes reported (given back by
    `settlement` if the update is rejected); `tamper`: applied to the delta and sample count before
    encoding; `should_stop`: polled between steps (raises `training.Stopped`)."""
    hp = task.hparams
    algorithm = algorithms.get(task.algorithm)
    settings = local_settings(hp)
    epochs_reason = "fixed by the coordinator"
    if settings.epochs == 0:
        asked = budget.clock()
        speed = budget.speed()
        plan = plan_epochs(speed, len(train), budget.seconds - (budget.clock() - asked),
                           tau=float(state.get(algorithm.name, {}).get("tau", 0.0)),
                           passes_per_step=float(hp.get("passes_per_step", 1.0)))
        settings.epochs, epochs_reason = plan.epochs, plan.reason
    before = copy.deepcopy(state.get(algorithm.name, {}))  # restored unless the update is folded
    rule = algorithm.client(hp, task.broadcast, state.setdefault(algorithm.name, {}), released)
    result = train_locally(model, train, rule, settings, seed, should_stop=should_stop,
                           objective=Objective.of(task.task, task.loss))
    metrics = result.metrics
    metrics["epochs_reason"] = epochs_reason
    if settings.dp:  # spent once the update exists, whatever the coordinator makes of it
        metrics["dp_epsilon"] = dp_sgd.spend(state.setdefault("dp_sgd", []), settings.dp,
                                             float(metrics["dp_sample_rate"]), int(metrics["steps"]))
    metrics.update(report or {})
    metrics.update(down or {})
    ef = state.setdefault("codec", {})  # error feedback: what top-k has not sent yet
    claims = list(ef.get("owed", []))
    if claims:  # earlier updates its residual still owes (never folded): the coordinator checks them
        metrics["owed"] = " ".join(claims)
    delta, num_samples = result.delta, result.num_samples
    if tamper is not None:
        delta, num_samples = tamper(delta, num_samples)
    old_residual = ef.get("residual")
    encoded = codec.encode(delta, task.codec, old_residual, rounding)
    update = messages.Update(device, task.round, task.model_version, num_samples, metrics, encoded.body,
                             encoded.codec, encoded.specs, federation, task.attempt)
    payload = messages.encode_update(update, key, task.protocol)  # answered in the task's protocol
    sent = Sent(task, payload, algorithm.name, rule, before, delta, encoded, old_residual, dict(down or {}), claims)
    return Step(sent, result, settings.epochs, epochs_reason)
