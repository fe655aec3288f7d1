"""FedSMOO (Sun et al., ICML 2023, "Dynamic Regularized Sharpness Aware
Minimization in Federated Learning: Approaching Global Consistency and Smooth
Landscape"), as in the paper's code (FL-Simulator, optimizer/DRegSAM.py).

Client k keeps two duals on the device: h_k (FedDyn's, the sum of its past
updates) and mu_k (the perturbation dual). The server broadcasts the global
perturbation s with the model.

Client, per mini-batch:
    g  = grad L_k(theta);   d = g - mu_k - s;   eps = rho * d / ||d||
    mu_k <- mu_k + eps - s
    g <- grad L_k(theta + eps) + alpha * (theta - theta_t + h_k)
  after the round: h_k <- h_k + (theta_k - theta_t); send mu_k beside the delta
  (CPU-sized, `sam_every` = k: eps and the mu_k update happen on refresh steps only)
Server:
    H <- H + (|P|/m) * mean_{k in P}(theta_k - theta_t)
    theta_{t+1} = theta_t + mean_{k in P}(theta_k - theta_t) + H
    s = rho * mean_{k in P}(mu_k) / ||mean_{k in P}(mu_k)||

Parameters: rho = 0.05 (the peer measurement; the paper code's default is 0.1),
alpha = 0.1, sam_every = 1, weighting = "uniform" (the paper's mean).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .base import EXTRA_PREFIX, Scalar, Tensors, from_numpy, hp, to_numpy
from .feddyn import DualServer, DualState
from .sam import SAMClient

NAME = "fedsmoo"
DEFAULT_HPARAMS: dict[str, float | str] = {
    "rho": 0.05, "alpha": 0.1, "sam_every": 1, "weighting": "uniform", "dual_decay": 1.0}
MU = EXTRA_PREFIX + "mu"      # one tensor per parameter: "extra.mu.<param name>"
S = EXTRA_PREFIX + "s"        # the global perturbation, released with the model: "extra.s.<param name>"


class PerturbationDual:
    """Client side of FedSMOO's smoothness consensus: the perturbation dual mu_k (kept
    on the device) and the global perturbation s (received with the model)."""

    def load_perturbation_dual(self, model, global_params: Tensors) -> None:
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        stored = self.state.get("mu")
        self.mu = from_numpy(stored) if stored is not None else [torch.zeros_like(p) for p in global_params]
        self.s = [torch.from_numpy(np.asarray(self.tensors[f"{S}.{n}"], dtype=np.float32).copy())
                  if f"{S}.{n}" in self.tensors else torch.zeros_like(p)
                  for n, p in zip(self.names, global_params)]

    def corrected_ascent(self, grads: Tensors) -> Tensors:
        return [g - mu - s for g, mu, s in zip(grads, self.mu, self.s)]

    def update_perturbation_dual(self, eps: Tensors) -> None:
        for mu, e, s in zip(self.mu, eps, self.s):
            mu.add_(e - s)

    def store_perturbation_dual(self) -> None:
        self.state["mu"] = to_numpy(self.mu)

    def perturbation_dual_tensors(self) -> dict[str, np.ndarray]:
        return {f"{MU}.{n}": mu.numpy().copy() for n, mu in zip(self.names, self.mu)}


class GlobalPerturbation:
    """Server side: s = rho * mean(mu_k) / ||mean(mu_k)||, released with the model."""

    def __init__(self, rho: float):
        self.rho = rho
        self.s: dict[str, np.ndarray] = {}

    @staticmethod
    def specs(model_specs: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return {f"{MU}.{n}": shape for n, shape in model_specs.items()}

    def update(self, names, mean_extras: Mapping[str, np.ndarray]) -> None:
        mean_mu = {n: mean_extras[f"{MU}.{n}"].astype(np.float64) for n in names}
        size = np.sqrt(sum(float(np.sum(a * a)) for a in mean_mu.values())) + 1e-7
        self.s = {f"{S}.{n}": (self.rho * a / size).astype(np.float32) for n, a in mean_mu.items()}

    def load(self, stored: Mapping[str, np.ndarray]) -> None:
        self.s = {name: np.asarray(a, dtype=np.float32) for name, a in stored.items()}


class Client(DualState, PerturbationDual, SAMClient):
    def begin(self, model, global_params: Tensors, total_steps: int, num_samples: int) -> None:
        super().begin(model, global_params, total_steps, num_samples)
        self.load_dual(global_params)
        self.load_perturbation_dual(model, global_params)

    def ascent_direction(self, step: int, grads: Tensors) -> Tensors:
        return self.corrected_ascent(grads)

    def after_ascent(self, step: int, eps: Tensors) -> None:
        self.update_perturbation_dual(eps)

    def adjust_gradients(self, step: int, params: Tensors) -> None:
        self.add_dual_correction(params, hp(self.hparams, DEFAULT_HPARAMS, "alpha"))

    def end(self, params: Tensors) -> dict[str, Scalar]:
        self.store_dual(params)
        self.store_perturbation_dual()
        return {}

    def extra_tensors(self) -> dict[str, np.ndarray]:
        return self.perturbation_dual_tensors()


class Server(DualServer):
    def __init__(self, hparams: Mapping[str, Scalar]):
        super().__init__({**DEFAULT_HPARAMS, **hparams})
        self.perturbation = GlobalPerturbation(float(self.hparams["rho"]))

    @property
    def s(self) -> dict[str, np.ndarray]:
        return self.perturbation.s

    def extra_specs(self, model_specs):
        return self.perturbation.specs(model_specs)

    def new_global(self, global_params, mean_delta, mean_extras=None) -> dict[str, np.ndarray]:
        self.perturbation.update(global_params, mean_extras)
        return super().new_global(global_params, mean_delta)

    def broadcast_tensors(self) -> dict[str, np.ndarray]:
        return dict(self.perturbation.s)

    def state(self) -> dict:
        return {**super().state(), "s": self.perturbation.s}

    def load_state(self, state) -> None:
        super().load_state(state)
        self.perturbation.load(state.get("s", {}))
