"""What this device can do: a psutil probe, a training-speed calibration, and
the choice of local epochs (DRSAM.md 4.4).

Epochs run from 3 on a weak device to 8 on a strong one, by measured training
throughput (samples per second for this model) between two reference speeds;
they are halved when the client's instability tau is high, and capped so that
the estimated training time fits before the round deadline with a margin.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import psutil
import torch
from torch import nn

from .limits import apply as apply_limits
from .optim import LocalSGD

MIN_EPOCHS, MAX_EPOCHS = 3, 8
HIGH_TAU = 0.15  # radians
DEADLINE_MARGIN = 0.7  # plan to use at most this share of the time left


def probe() -> dict[str, float | int | str]:
    """Cores, frequency, memory, load, and temperature / battery where the board reports them."""
    profile: dict[str, float | int | str] = {
        "cores": psutil.cpu_count(logical=True) or 1,
        "memory_mb": round(psutil.virtual_memory().total / 2**20),
        "memory_available_mb": round(psutil.virtual_memory().available / 2**20),
        "load1": round(os.getloadavg()[0], 2),
    }
    try:
        freq = psutil.cpu_freq()
        if freq and freq.max:
            profile["cpu_mhz_max"] = round(freq.max)
    except (OSError, NotImplementedError, FileNotFoundError):
        pass
    temps = getattr(psutil, "sensors_temperatures", lambda: {})() or {}
    readings = [t.current for entries in temps.values() for t in entries if t.current]
    if readings:
        profile["temperature_c"] = round(max(readings), 1)
    battery = getattr(psutil, "sensors_battery", lambda: None)()
    if battery is not None:
        profile["battery_percent"] = round(battery.percent, 1)
        profile["on_power"] = bool(battery.power_plugged)
    return apply_limits(profile)  # what the kernel enforces: cgroup CPU quota and memory limit (limits.py)


def calibrate(model: nn.Module, input_shape: tuple[int, ...], num_classes: int, batch_size: int = 32,
              seconds: float = 1.0, max_steps: int = 50) -> float:
    """Training samples per second: SGD steps on random data for about `seconds`, on a copy of the model."""
    import copy
    trial = copy.deepcopy(model)
    optimizer = LocalSGD(list(trial.parameters()), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(batch_size, *input_shape)
    y = torch.randint(0, num_classes, (batch_size,))
    loss_fn(trial(x), y).backward()  # warm-up step, not timed
    steps, started = 0, time.perf_counter()
    while steps < max_steps and (time.perf_counter() - started < seconds or steps < 3):
        optimizer.zero_grad()
        loss_fn(trial(x), y).backward()
        optimizer.step()
        steps += 1
    return steps * batch_size / (time.perf_counter() - started)


@dataclass
class EpochPlan:
    epochs: int
    reason: str


def plan_epochs(samples_per_s: float, num_samples: int, seconds_left: float, tau: float = 0.0,
                passes_per_step: float = 1.0, slow: float = 200.0, fast: float = 5000.0) -> EpochPlan:
    """Local epochs for this round.

    `passes_per_step` is the algorithm's cost in forward-backward passes (2 for
    plain SAM). `slow` and `fast` are the reference throughputs (samples/s) that
    map to 3 and 8 epochs; speeds between are placed on a log scale.
    """
    position = (math.log(max(samples_per_s, 1e-9)) - math.log(slow)) / (math.log(fast) - math.log(slow))
    epochs = MIN_EPOCHS + round((MAX_EPOCHS - MIN_EPOCHS) * min(1.0, max(0.0, position)))
    reason = f"speed {samples_per_s:.0f} samples/s"
    if tau > HIGH_TAU:
        epochs = max(1, epochs // 2)
        reason += f", halved for tau {tau:.2f} > {HIGH_TAU}"
    seconds_per_epoch = num_samples * passes_per_step / max(samples_per_s, 1e-9)
    fits = int(seconds_left * DEADLINE_MARGIN // seconds_per_epoch) if seconds_per_epoch > 0 else epochs
    if fits < epochs:
        epochs = max(1, fits)
        reason += f", capped to fit {seconds_left:.0f} s before the deadline"
    return EpochPlan(epochs, reason)
