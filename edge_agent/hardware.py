"""What this device can do: a psutil probe, a training-speed calibration, and
the choice of local epochs (docs/DRSAM.md "Local epochs").

Epochs run from 3 on a weak device to 8 on a strong one, by measured training
throughput (samples per second for this model) between two reference speeds;
they are halved when the client's instability tau is high, and capped so that
the estimated training time fits before the round deadline with a margin.
"""

from __future__ import annotations

import math
import os
import platform
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

from .limits import apply as apply_limits
from .optim import LocalSGD

MIN_EPOCHS, MAX_EPOCHS = 3, 8
HIGH_TAU = 0.15  # radians
DEADLINE_MARGIN = 0.7  # plan to use at most this share of the time left


def _read(call, default=None):
    """A psutil or os reading, or `default` where this board has no such sensor or file.

    Boards differ: no battery, no thermal zone, no cpufreq, /sys/class/power_supply
    missing (psutil raises FileNotFoundError for that one). A missing reading is
    left out of the profile rather than stopping the agent.
    """
    try:
        return call()
    except (OSError, NotImplementedError, AttributeError, RuntimeError, ValueError):
        return default


def probe() -> dict[str, float | int | str]:
    """Cores, frequency, memory, load, and temperature / battery where the board reports them."""
    memory = _read(psutil.virtual_memory)
    profile: dict[str, float | int | str] = {"cores": _read(lambda: psutil.cpu_count(logical=True)) or 1}
    if memory is not None:
        profile["memory_mb"] = round(memory.total / 2**20)
        profile["memory_available_mb"] = round(memory.available / 2**20)
    load = _read(os.getloadavg)
    if load:
        profile["load1"] = round(load[0], 2)
    freq = _read(psutil.cpu_freq)
    if freq and freq.max:
        profile["cpu_mhz_max"] = round(freq.max)
    temps = _read(lambda: psutil.sensors_temperatures()) or {}
    readings = [t.current for entries in temps.values() for t in entries if t.current]
    if readings:
        profile["temperature_c"] = round(max(readings), 1)
    battery = _read(lambda: psutil.sensors_battery())
    if battery is not None:
        profile["battery_percent"] = round(battery.percent, 1)
        profile["on_power"] = bool(battery.power_plugged)
    return apply_limits(profile)  # what the kernel enforces: cgroup CPU quota and memory limit (limits.py)


AT_HWCAP = 16
HWCAP_AARCH64_ATOMICS = 1 << 8  # ARMv8.1 LSE atomics: Cortex-A76 (Pi 5) has them, Cortex-A72 (Pi 4) does not


def _aarch64_without_atomics() -> bool:
    """True on an ARMv8.0 core such as the Pi 4's, read from the kernel's (or qemu's) auxiliary vector."""
    if platform.machine() != "aarch64":
        return False
    try:
        words = Path("/proc/self/auxv").read_bytes()
    except OSError:
        return False
    for i in range(0, len(words) - 15, 16):
        key, value = struct.unpack_from("<QQ", words, i)
        if key == AT_HWCAP:
            return not value & HWCAP_AARCH64_ATOMICS
    return False


def default_threads(cores: int | None = None) -> int:
    """Torch threads when the config says 0: cores minus one (one left for the OS and MQTT), at least one.

    PyTorch's CUDA builds for aarch64 (what `pip install torch` gives there) use
    ARMv8.1 atomics in their threaded BLAS and crash with SIGILL on a Pi 4 once
    two or more threads train; with such a build on such a core, one thread.
    The CPU builds the README installs (Debian's python3-torch) run the default on
    both Pi 4 and Pi 5 (`make pi-check`, bench/results/pi_check.json).
    """
    cores = cores or os.cpu_count() or 2
    if torch.version.cuda is not None and _aarch64_without_atomics():
        return 1
    return max(1, cores - 1)


def calibrate(model: nn.Module, input_shape: tuple[int, ...], batch_size: int = 32,
              seconds: float = 1.0, max_steps: int = 50,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Training samples per second: SGD steps on random data for about `seconds`, on a copy of the model.
    The loss is the outputs' mean square: any model's, whatever its task, at a real backward's cost.
    `clock`: wall time on a device (what its deadline sees, under its own load); a benchmark that
    emulates devices passes the thread's CPU time, so that other jobs on its host do not slow them."""
    import copy
    trial = copy.deepcopy(model)
    optimizer = LocalSGD(list(trial.parameters()), lr=1e-3)
    x = torch.randn(batch_size, *input_shape)
    trial(x).square().mean().backward()  # warm-up step, not timed
    steps, started = 0, clock()
    while steps < max_steps and (clock() - started < seconds or steps < 3):
        optimizer.zero_grad()
        trial(x).square().mean().backward()
        optimizer.step()
        steps += 1
    return steps * batch_size / max(clock() - started, 1e-9)


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
