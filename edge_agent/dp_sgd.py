"""Sample-level DP-SGD on the device (`[privacy] device = "dp-sgd"`, docs/PRIVACY.md).

Each step's gradient is the mean over the batch of per-example gradients, each clipped to L2 norm C,
plus Gaussian noise of standard deviation z C on their sum (Abadi et al., CCS 2016). The per-example
gradients come from Opacus's `GradSampleModule` (pip install 'edgefl[device-privacy]'); its RDP
accountant turns the device's steps into the device's own epsilon at the task's delta, which the
device persists across rounds and reports with each update and in its status. The accountant
assumes Poisson sampling of each batch at rate batch / samples; the loop draws shuffled batches of
fixed size, the usual approximation (Opacus's own default data loader does the same).

What is privatized is the gradient of the data; the algorithm's own terms (FedProx's pull, FedDyn's
dual) are added after the noise, as they read no example. The SAM family's ascent pass reads the
data a second time each step, which would need its own clipping, noise and accounting: the
coordinator refuses dp-sgd with those algorithms at config load (settings/composition.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from edgefl_protocol.errors import Rejected

MIN_TORCH = (2, 6)  # what Opacus 1.6 needs
# Opacus's hooks on the first layer, whose input (the data) needs no gradient: torch's notice is benign
BENIGN = "Full backward hook is firing when gradients are computed with respect to module outputs"
UNAVAILABLE = "dp_sgd_unavailable"


@dataclass
class DeviceDP:
    noise_multiplier: float  # z: noise std over the clip
    clip: float  # C: each example's gradient is clipped to this L2 norm
    delta: float


def from_task(hparams: dict) -> DeviceDP | None:
    """The task's DP-SGD settings (None: the federation does not ask for it), range-checked, or Rejected."""
    if "dp_sgd_clip" not in hparams:
        return None
    values = {k: hparams.get(k) for k in ("dp_sgd_noise", "dp_sgd_clip", "dp_sgd_delta")}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()):
        raise Rejected("task_settings", f"dp_sgd_noise, dp_sgd_clip and dp_sgd_delta must be numbers, got {values}")
    dp = DeviceDP(float(values["dp_sgd_noise"]), float(values["dp_sgd_clip"]), float(values["dp_sgd_delta"]))
    if not (0 < dp.noise_multiplier < 1e3 and 0 < dp.clip < 1e6 and 0 < dp.delta < 1):
        raise Rejected("task_settings", f"dp-sgd needs noise > 0, clip > 0 and delta in (0, 1), the task says {values}")
    return dp


def unavailable(version: str = torch.__version__) -> str | None:
    """Why this device cannot run DP-SGD (None: it can)."""
    numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    if numbers < MIN_TORCH:
        return (f"[privacy] device = \"dp-sgd\" needs Opacus, which needs torch >= {'.'.join(map(str, MIN_TORCH))}; "
                f"this device has torch {version}")
    try:
        import opacus  # noqa: F401
    except ImportError:
        return "[privacy] device = \"dp-sgd\" needs Opacus on the device: pip install 'edgefl[device-privacy]'"
    return None


def per_example_model(model: nn.Module) -> nn.Module:
    """The model wrapped so that a backward pass leaves each parameter's per-example gradients, or
    Rejected when a layer has none (batch norm mixes the examples of a batch)."""
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    problems = ModuleValidator.validate(model, strict=False)
    if problems:
        raise Rejected(UNAVAILABLE, f"model cannot train with per-example gradients: {problems[0]}")
    return GradSampleModule(model, loss_reduction="sum")


def private_backward(model: nn.Module, params: Sequence[torch.Tensor], loss_fn: Callable, x: torch.Tensor,
                     y: torch.Tensor, dp: DeviceDP, noise: torch.Generator) -> float:
    """One step's privatized gradient into each parameter's .grad; returns the batch's mean loss."""
    for p in params:
        p.grad = None
        p.grad_sample = None
    loss = loss_fn(model(x), y)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=BENIGN)
        (loss * len(y)).backward()  # a sum over examples: each grad_sample is one example's gradient
    samples = [p.grad_sample.reshape(len(y), -1) for p in params]
    norms = torch.cat(samples, dim=1).norm(dim=1)
    scale = (dp.clip / (norms + 1e-12)).clamp(max=1.0)
    with torch.no_grad():
        for p in params:
            summed = torch.einsum("b,b...->...", scale, p.grad_sample)
            summed += torch.normal(0.0, dp.noise_multiplier * dp.clip, summed.shape, generator=noise)
            p.grad = summed / len(y)
            p.grad_sample = None
    return float(loss.detach())


def noise_generator() -> torch.Generator:
    """Seeded from the operating system's CSPRNG each round: noise no one can replay from the device's seed."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))


def epsilon(history: Sequence[Sequence[float]], delta: float) -> float:
    """The device's epsilon at `delta` over its steps so far: history of (z, sample rate, steps)."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(z), float(q), int(n)) for z, q, n in history]
    return float(accountant.get_epsilon(delta)) if accountant.history else 0.0


def spend(ledger: list, dp: DeviceDP, sample_rate: float, steps: int) -> float:
    """Book a round's steps in the device's persisted ledger, [(z, sample rate, steps), ...], and return
    its epsilon at the task's delta. Booked when the update is made, whatever the coordinator does
    with it: what left the device is spent. Rounds at the same (z, sample rate) share one row."""
    if steps and ledger and list(ledger[-1][:2]) == [dp.noise_multiplier, sample_rate]:
        ledger[-1][2] += steps
    elif steps:
        ledger.append([dp.noise_multiplier, sample_rate, steps])
    return epsilon(ledger, dp.delta)
