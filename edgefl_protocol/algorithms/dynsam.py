"""DynSAM: FedDyn's drift-correcting dual + CPU-sized SAM whose per-client
radius and pull strength come from DR-SAM's free local signals, normalized by
the federation's running medians. The project's own algorithm
(docs/DRSAM.md "`dynsam`" explains why DR-SAM as written needed it).

What it keeps from DR-SAM: per-client, per-round strengths from sharpness
(sigma) and consistency (gamma) measured on passes training does anyway.
What it fixes: (1) the pull toward theta_t only shrinks updates; a FedDyn dual
h_k (Acar et al., ICLR 2021) *corrects* the drift instead; (2) raw signals put
lambda at its cap most of the time; here each signal is divided by the
federation's running median (broadcast by the server), so a typical client
gets factor 1 and only outliers move; (3) SAM costs 2x; here the ascent is
refreshed every k steps and reused in between (about (1 + 1/k) x SGD; k = 4 by default).

Client k, round t (theta_t received; first-pass gradients g = grad L_k(theta)):
    fresh steps (every k-th): eps = rho_k * g / ||g||         (reused on the steps in between)
    descent:  g_k = grad L_k(theta + eps) + alpha_k * (theta - theta_t + h_k)
    after the round:  h_k <- h_k + (theta_k - theta_t)
    rho_k   = rho   * clamp(median_sigma / sigma_k, 1/r, r)       (sharper than typical: smaller radius)
    alpha_k = alpha * clamp((1 - gamma_k) / median(1 - gamma), 1/r, r) ** adapt_alpha
              * (mean_n / n_k) ** size_aware
    sigma_k = mean over fresh steps of L(theta + eps) - L(theta) (clamped at 0), gamma_k =
    cos(g_fin, g_ref) of the first and last fresh gradients, both from this client's previous
    participation (factor 1 until it has one, or while the medians are unknown).
Server:
    H <- H + (|P|/m) * mean_P(theta_k - theta_t);   theta_{t+1} = theta_t + mean_P(theta_k - theta_t) + H
    broadcast running medians of sigma and 1 - gamma over devices' latest reports, and mean n.

Options (off: they lost on the validation split, bench/results/algorithms_validation.md):
    global_perturbation  FedSMOO's ascent d = g - mu_k - s with its perturbation dual mu_k (sent
                         beside the delta) and the server's s (fedsmoo.py's parts)
    balanced_loss        the balanced-softmax loss of the client's own label counts (losses.py)

Measured in the lab (bench/results/algorithms.md: in process, float32, 2 fixed
epochs): it beats FedAvg by 1.5-2 points on the headline setting but ties
FedSMOO, and its ablation shows the dual does the work while the signal
adaptation adds nothing measurable. Measured in the field (bench/results/field.md:
real processes on an emulated mixed fleet, the default lossy codec,
device-chosen epochs, deadlines, churn) it is the best row within 1.3x FedAvg's
passes, so it is the runtime's default algorithm.

Parameters (defaults): alpha 0.1, rho 0.05, sam_every 4 (CPU-sized; chosen on validation), ratio r 2, adapt_rho 1,
adapt_alpha 1, size_aware 0, sam 1, dual 1, weighting "uniform", global_perturbation 0, balanced_loss 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import numpy as np

from .base import Scalar, Tensors, cosine, grads_of
from .feddyn import DualServer, DualState
from .fedsmoo import GlobalPerturbation, PerturbationDual
from .losses import BalancedSoftmaxLoss
from .sam import SAMClient

NAME = "dynsam"
DEFAULT_HPARAMS: dict[str, float | str] = {
    "alpha": 0.1, "rho": 0.05, "sam_every": 4, "ratio": 2.0, "adapt_rho": 1, "adapt_alpha": 1,
    "size_aware": 0, "sam": 1, "dual": 1, "weighting": "uniform", "global_perturbation": 0,
    "balanced_loss": 0, "dual_decay": 1.0,
}


def ratio_factor(typical: float, own: float | None, r: float) -> float:
    """clamp(typical / own, 1/r, r); 1 when either is unknown or zero."""
    if own is None or own <= 0 or typical <= 0:
        return 1.0
    return min(max(typical / own, 1 / r), r)


class Client(DualState, PerturbationDual, SAMClient):
    def h(self, name: str) -> float:
        return float(self.hparams.get(name, DEFAULT_HPARAMS[name]))

    def loss_function(self, labels):
        if self.h("balanced_loss"):
            return BalancedSoftmaxLoss(labels)
        return super().loss_function(labels)

    def begin(self, model, global_params: Tensors, total_steps: int, num_samples: int) -> None:
        super().begin(model, global_params, total_steps, num_samples)
        if self.h("dual"):
            self.load_dual(global_params)
        if self.h("global_perturbation"):
            self.load_perturbation_dual(model, global_params)
        r = self.h("ratio")
        st, b = self.state, self.broadcast
        self.rho_k = self.h("rho")
        if self.h("adapt_rho"):
            self.rho_k *= ratio_factor(float(b.get("median_sigma", 0.0)), st.get("sigma"), r)
        self.alpha_k = self.h("alpha")
        if self.h("adapt_alpha") and st.get("gamma") is not None:
            # more disagreement than typical: stronger pull (inverse ratio: own / typical)
            typical = float(b.get("median_disagreement", 0.0))
            own = 1.0 - float(st["gamma"])
            self.alpha_k *= 1.0 / ratio_factor(typical, own, r) if own > 0 else 1 / r
        if self.h("size_aware") and float(b.get("mean_samples", 0.0)) > 0:
            self.alpha_k *= float(b["mean_samples"]) / max(1, self.num_samples)
        self.diffs: list[float] = []
        self.g_ref: Tensors | None = None
        self.g_last: Tensors | None = None

    def radius(self, step: int) -> float:
        return self.rho_k

    def ascent_direction(self, step: int, grads: Tensors) -> Tensors:
        return self.corrected_ascent(grads) if self.h("global_perturbation") else grads

    def after_ascent(self, step: int, eps: Tensors) -> None:
        if self.h("global_perturbation"):
            self.update_perturbation_dual(eps)

    def perturbation(self, step: int, params: Tensors, loss: float | None) -> Tensors | None:
        if loss is not None:  # a fresh first pass: free signal material
            grads = grads_of(params)
            if self.g_ref is None:
                self.g_ref = grads
            self.g_last = grads
        if not self.h("sam"):
            return None
        return super().perturbation(step, params, loss)

    def observe_perturbed(self, step: int, loss: float | None, loss_perturbed: float) -> None:
        super().observe_perturbed(step, loss, loss_perturbed)
        if loss is not None:
            self.diffs.append(loss_perturbed - loss)

    def adjust_gradients(self, step: int, params: Tensors) -> None:
        if self.h("dual"):
            self.add_dual_correction(params, self.alpha_k)

    def end(self, params: Tensors) -> dict[str, Scalar]:
        if self.h("dual"):
            self.store_dual(params)
        if self.h("global_perturbation"):
            self.store_perturbation_dual()
        sigma = max(0.0, sum(self.diffs) / len(self.diffs)) if self.diffs else None
        if getattr(self, "previous", None) is not None and self.total_steps > 1:
            self.g_last = self.previous  # free-ascent mode: the last descent gradient
        gamma = cosine(self.g_last, self.g_ref) if self.g_ref is not None and self.g_last is not self.g_ref else None
        if sigma is not None:
            self.state["sigma"] = sigma
        if gamma is not None:
            self.state["gamma"] = gamma
        metrics: dict[str, Scalar] = {"rho": self.rho_k if self.h("sam") else 0.0, "alpha": self.alpha_k}
        if sigma is not None:
            metrics["sigma"] = sigma
        if gamma is not None:
            metrics["gamma"] = gamma
        return metrics

    def extra_tensors(self) -> dict[str, np.ndarray]:
        return self.perturbation_dual_tensors() if self.h("global_perturbation") else {}


class Server(DualServer):
    def __init__(self, hparams: Mapping[str, Scalar]):
        super().__init__({**DEFAULT_HPARAMS, **hparams})
        self.latest: dict[str, dict[str, float]] = {}
        self.perturbation = GlobalPerturbation(float(self.hparams["rho"]))
        self.smooth = bool(float(self.hparams["global_perturbation"]))

    def extra_specs(self, model_specs):
        return self.perturbation.specs(model_specs) if self.smooth else {}

    def broadcast_tensors(self) -> dict[str, np.ndarray]:
        return dict(self.perturbation.s)

    def new_global(self, global_params, mean_delta, mean_extras=None):
        if self.smooth:
            self.perturbation.update(global_params, mean_extras)
        if not float(self.hparams["dual"]):
            return {n: global_params[n] + mean_delta[n] for n in global_params}
        return super().new_global(global_params, mean_delta, mean_extras)

    def observe(self, device: str, num_samples: int, metrics: Mapping[str, Scalar]) -> None:
        super().observe(device, num_samples, metrics)
        seen = self.latest.setdefault(device, {})
        seen["n"] = float(num_samples)
        for key in ("sigma", "gamma"):
            if key in metrics:
                seen[key] = float(metrics[key])

    def state(self) -> dict:
        return {**super().state(), "latest": self.latest, "s": self.perturbation.s}

    def load_state(self, state) -> None:
        super().load_state(state)
        self.perturbation.load(state.get("s", {}))
        self.latest = {d: dict(v) for d, v in state.get("latest", {}).items()}

    def broadcast(self) -> dict[str, Scalar]:
        sigmas = [s["sigma"] for s in self.latest.values() if "sigma" in s]
        disagreements = [1 - s["gamma"] for s in self.latest.values() if "gamma" in s]
        sizes = [s["n"] for s in self.latest.values()]
        return {**super().broadcast(),
                "median_sigma": statistics.median(sigmas) if sigmas else 0.0,
                "median_disagreement": statistics.median(disagreements) if disagreements else 0.0,
                "mean_samples": sum(sizes) / len(sizes) if sizes else 0.0}
