"""DR-SAM, "Dynamic Regularized SAM", exactly as the project's design note
describes it (docs/DRSAM.md; not the ICML 2023 paper, which is
`fedsmoo`). Each client derives, each round, a consistency strength lambda_k
and a SAM radius rho_k from three signals it measures for free.

Signals (client k; m = 5 steps; first-pass gradients, i.e. grad L at theta):
    g_ref = mean gradient of the first m steps,  g_fin = mean gradient of the last m steps
    gamma = cos(g_fin, g_ref)        (option: ||g_ref|| replaced by its running mean)
    sigma = mean_{first m steps} [L(theta + eps) - L(theta)];  sigma = max(0, sigma);
            sigma = 0 if |sigma| < 0.01 L(theta);  raw sigma < -0.05: the next step perturbs
            along a random unit direction and sigma is re-measured from that step
    tau   = std of the last 5 angles between successive participations' g_fin (0 below 2 angles)
Strengths:
    lambda_raw = a (1 - gamma) + b sigma + c tau;   lambda = clip(lambda_raw, lambda_min, lambda_max)
    rho        = max(rho_min, rho_max_k exp(-lambda))
    rho_max_k  = rho_max * clamp(median_sigma / sigma_bar_k, 0.25, 4) once the server broadcasts
                 median_sigma (after the first 10 rounds; sigma_bar_k = this client's mean sigma
                 over its participations in them; sigma_bar_k = 0 keeps rho_max)
Timing (docs/DRSAM.md "Strengths"): steps < m use the lambda, rho this client ended its previous
participation with (first participation: lambda = 0, rho = rho_max_k); after step m they are
recomputed from this round's sigma and the previous participation's gamma and tau.
Warm-up (first 3 rounds): gamma := 1, lambda := 0, no perturbation: exactly FedAvg's local update.
Local step (note section 3.3): g_reg = grad L(theta + eps) + 2 lambda (theta - theta_t), then
clip_grad_norm(g_reg, 10), then SGD (+momentum): the pull enters the momentum with the data.
Local epochs: E is halved (at least 1) when the previous tau exceeds 0.15 rad (with local_epochs = 0
the agent's hardware plan, edge_agent/hardware.py, applies this rule itself).
CPU-sized (`sam_every` = k > 1): fresh SAM passes in the first and last m steps (the signals need
them) and every k-th step; the last eps is reused in between (k = 0: eps follows the previous
step's descent gradient outside the first and last m steps; see sam.py).

Server:
    weights p_k ~ n_k (default) or n_k exp(-lambda_k) (`lambda_weighting` = 1)
    selection: the coordinator's `selection = "stability"` policy (broker_coordinator/engine/selection.py)
      implements the note's stability-aware selection from the signals reported here
    broadcast: round, warmup flag, median sigma (0 until the calibration rounds are over)

Parameters (defaults): a 0.4, b 0.5, c 0.1, lambda_min 0.01, lambda_max 0.3, rho_min 0.001,
rho_max 0.05, m 5, warmup_rounds 3, calibration_rounds 10, ratio_min 0.25, ratio_max 4,
tau_high 0.15, gamma_dynamic_baseline 0, halve_epochs 1, sam_every 1, lambda_weighting 0,
rho_from_smoothness 0, smoothness_samples 100. Gradient clipping (10) is the shared `grad_clip` setting.

Option rho_from_smoothness (note 4.4): during warm-up rounds the client estimates the gradient's
Lipschitz constant L as the largest ||g_s - g_{s-1}|| / ||theta_s - theta_{s-1}|| over the steps
covering its first `smoothness_samples` samples (free first-pass gradients, so successive
mini-batches: an over-estimate, hence a cautious radius); afterwards rho_max 1/(2L) (at least
rho_min) replaces the fixed rho_max, and the median-sigma ratio still applies on top.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .base import Scalar, ServerRule, Tensors, cosine, from_numpy, grads_of, norm, to_numpy
from .sam import SAMClient

NAME = "drsam"
DEFAULT_HPARAMS: dict[str, float | str] = {
    "a": 0.4, "b": 0.5, "c": 0.1, "lambda_min": 0.01, "lambda_max": 0.3, "rho_min": 0.001, "rho_max": 0.05,
    "m": 5, "warmup_rounds": 3, "calibration_rounds": 10, "ratio_min": 0.25, "ratio_max": 4.0,
    "tau_high": 0.15, "gamma_dynamic_baseline": 0, "halve_epochs": 1, "sam_every": 1,
    "lambda_weighting": 0, "weighting": "size", "rho_from_smoothness": 0, "smoothness_samples": 100,
}
NOISE_FRACTION = 0.01       # |sigma| below this fraction of L(theta) is numerical noise
RECALIBRATE_BELOW = -0.05   # raw sigma below this: re-measure along a random direction
TAU_QUEUE = 5               # angles kept for tau
GREF_MOMENTUM = 0.9         # running mean of ||g_ref|| for the dynamic-baseline option


# --- the formulas, as plain functions (tested against hand-computed values) -----------
def strengths(gamma: float, sigma: float, tau: float, rho_max_k: float, h: Mapping[str, float]) -> tuple[float, float, float]:
    """(lambda_raw, lambda, rho) from the three signals."""
    lambda_raw = h["a"] * (1 - gamma) + h["b"] * sigma + h["c"] * tau
    lam = min(max(lambda_raw, h["lambda_min"]), h["lambda_max"])
    rho = max(h["rho_min"], rho_max_k * math.exp(-lam))
    return lambda_raw, lam, rho


def clean_sigma(raw: float, loss: float) -> float:
    """Clamp at 0; a value within 1% of the loss is numerical noise."""
    sigma = max(0.0, raw)
    return 0.0 if abs(sigma) < NOISE_FRACTION * abs(loss) else sigma


def per_client_rho_max(rho_max: float, median_sigma: float, sigma_bar: float, low: float, high: float) -> float:
    if median_sigma <= 0 or sigma_bar <= 0:
        return rho_max
    return rho_max * min(max(median_sigma / sigma_bar, low), high)


def smoothness_ratio(params_before: Tensors, grads_before: Tensors, params: Tensors, grads: Tensors) -> float | None:
    """||g_t - g_{t-1}|| / ||theta_t - theta_{t-1}||, a local estimate of the Lipschitz constant L
    of the gradient (note 4.4); None when theta did not move."""
    moved = norm([p - q for p, q in zip(params, params_before)])
    if moved <= 0:
        return None
    return norm([g - f for g, f in zip(grads, grads_before)]) / moved


def rho_max_from_smoothness(smoothness: float, rho_min: float) -> float:
    """rho_max ~ 1/(2L): a radius above 2/L makes the SAM step increase the loss (note 4.4)."""
    return max(rho_min, 1.0 / (2.0 * smoothness))


def angle(a: Tensors, b: Tensors) -> float:
    return math.acos(min(1.0, max(-1.0, cosine(a, b))))


def tau_of(angles: Sequence[float]) -> float:
    return float(np.std(angles)) if len(angles) >= 2 else 0.0


class Signals:
    """gamma, sigma and tau measured from passes local training does anyway."""

    def __init__(self, m: int, total_steps: int):
        self.m = max(1, min(m, total_steps // 2))
        self.total_steps = total_steps
        self.ref_sum: Tensors | None = None
        self.fin_sum: Tensors | None = None
        self.ref_count = self.fin_count = 0
        self.diffs: list[float] = []
        self.losses: list[float] = []

    def in_first(self, step: int) -> bool:
        return step < self.m

    def in_last(self, step: int) -> bool:
        return step >= self.total_steps - self.m

    def add_gradient(self, step: int, grads: Tensors) -> None:
        if self.in_first(step):
            self.ref_sum = grads if self.ref_sum is None else [s + g for s, g in zip(self.ref_sum, grads)]
            self.ref_count += 1
        if self.in_last(step):
            self.fin_sum = grads if self.fin_sum is None else [s + g for s, g in zip(self.fin_sum, grads)]
            self.fin_count += 1

    def g_ref(self) -> Tensors:
        return [s / self.ref_count for s in self.ref_sum]

    def g_fin(self) -> Tensors:
        return [s / self.fin_count for s in self.fin_sum]


class Client(SAMClient):
    def h(self, name: str) -> float:
        return float(self.hparams.get(name, DEFAULT_HPARAMS[name]))

    def local_epochs(self, epochs: int) -> int:
        planned_by_agent = int(self.hparams.get("local_epochs", 1)) == 0  # plan_epochs already used tau
        if self.h("halve_epochs") and not planned_by_agent and self.state.get("tau", 0.0) > self.h("tau_high"):
            return max(1, epochs // 2)
        return epochs

    def begin(self, model, global_params: Tensors, total_steps: int, num_samples: int) -> None:
        super().begin(model, global_params, total_steps, num_samples)
        self.warmup = bool(self.broadcast.get("warmup", False))
        self.round = int(self.broadcast.get("round", 0))
        self.signals = Signals(int(self.h("m")), total_steps)
        sigma_history = self.state.get("sigma_history", [])
        sigma_bar = sum(sigma_history) / len(sigma_history) if sigma_history else 0.0
        rho_max = self.h("rho_max")
        if self.h("rho_from_smoothness") and self.state.get("smoothness"):
            rho_max = rho_max_from_smoothness(float(self.state["smoothness"]), self.h("rho_min"))
        self.rho_max_k = per_client_rho_max(rho_max, float(self.broadcast.get("median_sigma", 0.0)),
                                            sigma_bar, self.h("ratio_min"), self.h("ratio_max"))
        # the smoothness probe: warm-up rounds, the steps covering the first ~100 samples
        batch = max(1, int(self.hparams.get("batch_size", 32)))
        self.probe_steps = math.ceil(self.h("smoothness_samples") / batch) if (
            self.warmup and self.h("rho_from_smoothness")) else 0
        self.probe_last: tuple[Tensors, Tensors] | None = None
        self.smoothness: float | None = None
        if self.warmup:
            self.lam, self.rho = 0.0, self.rho_max_k
        else:  # the strengths this client ended its previous participation with
            self.lam = float(self.state.get("lambda", 0.0))
            self.rho = float(self.state.get("rho", self.rho_max_k))
        self.lambda_raw = self.lam
        self.sigma: float | None = None
        self.recalibrate_at: int | None = None

    # SAM-family hooks ---------------------------------------------------------------
    def radius(self, step: int) -> float:
        return self.rho

    def fresh_ascent(self, step: int) -> bool:
        s = self.signals
        return s.in_first(step) or s.in_last(step) or step == self.recalibrate_at or super().fresh_ascent(step)

    def ascent_direction(self, step: int, grads: Tensors) -> Tensors:
        if step == self.recalibrate_at:  # the note's "direction recalibration"
            generator = torch.Generator().manual_seed(1000 * self.round + step)
            return [torch.randn(g.shape, generator=generator) for g in grads]
        return grads

    def wants_clean_gradient(self, step: int) -> bool:
        return self.warmup or super().wants_clean_gradient(step)

    def perturbation(self, step: int, params: Tensors, loss: float | None) -> Tensors | None:
        if loss is not None and (self.signals.in_first(step) or self.signals.in_last(step)):
            self.signals.add_gradient(step, grads_of(params))
        if loss is not None and step < self.probe_steps:
            self._probe_smoothness(params)
        if self.warmup:
            return None
        return super().perturbation(step, params, loss)

    def observe_perturbed(self, step: int, loss: float | None, loss_perturbed: float) -> None:
        super().observe_perturbed(step, loss, loss_perturbed)
        if loss is None:
            return
        s = self.signals
        if step == self.recalibrate_at:  # re-measured along a random direction
            self._set_strengths(clean_sigma(loss_perturbed - loss, loss))
        elif s.in_first(step):
            s.diffs.append(loss_perturbed - loss)
            s.losses.append(loss)
            if step == s.m - 1:
                raw = sum(s.diffs) / len(s.diffs)
                if raw < RECALIBRATE_BELOW and step + 1 < self.total_steps:
                    self.recalibrate_at = step + 1
                else:
                    self._set_strengths(clean_sigma(raw, sum(s.losses) / len(s.losses)))

    def _probe_smoothness(self, params: Tensors) -> None:
        current = ([p.detach().clone() for p in params], grads_of(params))
        if self.probe_last is not None:
            ratio = smoothness_ratio(*self.probe_last, *current)
            if ratio is not None:
                self.smoothness = ratio if self.smoothness is None else max(self.smoothness, ratio)
        self.probe_last = current

    def _set_strengths(self, sigma: float) -> None:
        self.sigma = sigma
        gamma_prev = float(self.state.get("gamma", 1.0))
        tau_prev = float(self.state.get("tau", 0.0))
        self.lambda_raw, self.lam, self.rho = strengths(
            gamma_prev, sigma, tau_prev, self.rho_max_k, {k: self.h(k) for k in DEFAULT_HPARAMS if k != "weighting"})

    def adjust_gradients(self, step: int, params: Tensors) -> None:
        if self.warmup or self.lam == 0:
            return
        with torch.no_grad():  # the consistency term folded into the gradient (note 3.3)
            for p, g in zip(params, self.global_params):
                p.grad.add_(p - g, alpha=2 * self.lam)

    def end(self, params: Tensors) -> dict[str, Scalar]:
        s, st = self.signals, self.state
        g_ref, g_fin = s.g_ref(), s.g_fin()
        ref_norm = norm(g_ref)
        if self.h("gamma_dynamic_baseline"):
            running = st.get("g_ref_norm")
            running = ref_norm if running is None else GREF_MOMENTUM * running + (1 - GREF_MOMENTUM) * ref_norm
            st["g_ref_norm"] = running
            gamma = cosine(g_fin, g_ref, b_norm=running)
        else:
            gamma = cosine(g_fin, g_ref)
        if self.warmup:
            gamma = 1.0
        angles = list(st.get("angles", []))
        if st.get("g_fin") is not None:
            angles = (angles + [angle(g_fin, from_numpy(st["g_fin"]))])[-TAU_QUEUE:]
        tau = tau_of(angles)
        st.update({"g_fin": to_numpy(g_fin), "angles": angles, "gamma": gamma, "tau": tau,
                   "participations": int(st.get("participations", 0)) + 1})
        if self.smoothness is not None:  # the largest estimate over this client's warm-up rounds
            st["smoothness"] = max(self.smoothness, float(st.get("smoothness", 0.0)))
        if not self.warmup:
            st["lambda"], st["rho"] = self.lam, self.rho
            if self.sigma is not None and self.round <= self.h("calibration_rounds"):
                st["sigma_history"] = list(st.get("sigma_history", [])) + [self.sigma]
        return {"gamma": gamma, "sigma": self.sigma if self.sigma is not None else 0.0, "tau": tau,
                "lambda_raw": self.lambda_raw, "lambda": self.lam, "rho": 0.0 if self.warmup else self.rho,
                "rho_max_k": self.rho_max_k, "warmup": self.warmup,
                **({"smoothness": self.smoothness} if self.smoothness is not None else {})}


class Server(ServerRule):
    def __init__(self, hparams: Mapping[str, Scalar]):
        super().__init__({**DEFAULT_HPARAMS, **hparams})
        self.sigma_sums: dict[str, list[float]] = {}   # device -> [sum, count] over calibration rounds

    def h(self, name: str) -> float:
        return float(self.hparams[name])

    def warmup(self) -> bool:
        return self.round <= self.h("warmup_rounds")

    def median_sigma(self) -> float:
        if self.round <= self.h("calibration_rounds") or not self.sigma_sums:
            return 0.0
        return float(statistics.median(total / count for total, count in self.sigma_sums.values()))

    def broadcast(self) -> dict[str, Scalar]:
        return {"round": self.round, "warmup": self.warmup(), "median_sigma": self.median_sigma()}

    def weight(self, num_samples: int, metrics: Mapping[str, Scalar]) -> float:
        base = super().weight(num_samples, metrics)
        if self.h("lambda_weighting"):
            return base * math.exp(-float(metrics.get("lambda", 0.0)))
        return base

    def state(self) -> dict:
        return {"sigma_sums": {d: list(v) for d, v in self.sigma_sums.items()}}

    def load_state(self, state) -> None:
        self.sigma_sums = {d: [float(v[0]), int(v[1])] for d, v in state.get("sigma_sums", {}).items()}

    def observe(self, device: str, num_samples: int, metrics: Mapping[str, Scalar]) -> None:
        if not self.warmup() and self.round <= self.h("calibration_rounds") and "sigma" in metrics:
            acc = self.sigma_sums.setdefault(device, [0.0, 0])
            acc[0] += float(metrics["sigma"])
            acc[1] += 1
