"""Server optimizers: the FedOpt family (Reddi et al., ICLR 2021, "Adaptive Federated Optimization")
and server momentum (FedAvgM, Hsu et al. 2019), applied to every algorithm's server rule.

The algorithm's server rule proposes the next global model x' = new_global(x, mean delta, extras).
Its step splits in two: the clients' mean delta, and what the rule adds of its own (a dual
algorithm's H, the population mean of the devices' duals; zero for the others):

    x' - x_t = Delta_t + R_t

Delta_t is the pseudo-gradient (Reddi et al.'s Delta_t, a descent direction: clients' models minus
x); the server optimizer turns it into a step, per coordinate, and R_t is added as the rule made it:

    x_{t+1} = x_t + eta * D_t + R_t

where D_t is the optimizer's direction:

    sgd       D_t = Delta_t
    momentum  m_t = mu * m_{t-1} + Delta_t;                            D_t = m_t
    adagrad   m_t = b1 * m_{t-1} + (1 - b1) * Delta_t;   v_t = v_{t-1} + Delta_t^2
    adam      m_t as adagrad;                            v_t = b2 * v_{t-1} + (1 - b2) * Delta_t^2
    yogi      m_t as adagrad;                            v_t = v_{t-1} - (1 - b2) * Delta_t^2 * sign(v_{t-1} - Delta_t^2)
              (adaptive ones)                            D_t = m_t / (sqrt(v_t) + tau)

with m_{-1} = 0 and v_{-1} = tau^2 (Reddi et al.'s Algorithm 2 asks v_{-1} >= tau^2), and no bias
correction (their Algorithm 2 has none). Parameters, [server_optimizer] keys with their defaults: server_optimizer
"sgd"; server_lr eta (unset: 1.0 for sgd, 1 - mu for momentum, 0.01 for adam and yogi, 0.1 for
adagrad: `RoundSettings.server_step_size`); server_momentum mu 0.9; beta1 b1 0.9; beta2 b2 0.99;
tau 1e-3; server_lr_decay gamma 1: the step t (0 = the first) is taken at eta * gamma^t, as the clients'
lr_decay shrinks theirs per round. When every aggregate carries noise (DP's Gaussian noise, a
cohort's sampling) a fixed step leaves the model wandering by a distance that grows with the step;
a shrinking one narrows that, at the price of slower progress (on the private 1,000-of-10,000 cohort,
still climbing at round 40, 0.97 lost: docs/PRIVACY.md, "Which uplink").
sgd with eta 1 and gamma 1 returns x' itself: the server rule alone, bit for bit.

The engine applies it once per applied model: per round (sync, flat or in sites) and per version
(buffered). Why R_t stays outside the moments: H is itself a running sum of past mean deltas, so a
momentum on Delta_t + H would accumulate an accumulation (x moving by sums of sums), and an adaptive
optimizer would rescale the dual's correction by the clients' step statistics. Measured: on the
headline partition dynsam+sgd with server momentum ended at 36.5% (best 76.5%) when the optimizer
saw the whole step (docs/ALGORITHMS.md, "Server optimizers"). Its moments are checkpointed beside
the server rule's state (`Checkpoint.server_optimizer`) and restored on resume.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from broker_coordinator.settings.choices import SERVER_OPTIMIZERS
from broker_coordinator.settings.round_settings import RoundSettings

log = logging.getLogger("broker_coordinator")
ADAPTIVE = ("adam", "yogi", "adagrad")


class ServerOptimizer:
    """One server optimizer and its moments (float64, one array per model tensor: O(model))."""

    def __init__(self, name: str = "sgd", lr: float = 1.0, momentum: float = 0.9, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3, lr_decay: float = 1.0) -> None:
        if name not in SERVER_OPTIMIZERS:
            raise ValueError(f"server_optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {name!r}")
        self.name, self.lr, self.momentum = name, float(lr), float(momentum)
        self.beta1, self.beta2, self.tau = float(beta1), float(beta2), float(tau)
        self.lr_decay = float(lr_decay)
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.steps = 0  # steps taken (rounds or buffered versions that trained)

    @classmethod
    def of(cls, settings: RoundSettings) -> ServerOptimizer:
        return cls(settings.server_optimizer, settings.server_step_size(), settings.server_momentum,
                   settings.beta1, settings.beta2, settings.tau, settings.server_lr_decay)

    @property
    def is_identity(self) -> bool:
        """sgd at eta 1 that never decays: the server rule's model, untouched."""
        return self.name == "sgd" and self.lr == 1.0 and self.lr_decay == 1.0

    def step_size(self) -> float:
        """The learning rate of the next step: eta * gamma^(steps taken)."""
        return self.lr * self.lr_decay ** self.steps

    def describe(self) -> str:
        decay = f", server_lr_decay {self.lr_decay:g}" if self.lr_decay != 1.0 else ""
        if self.name == "sgd":
            return f"sgd (server_lr {self.lr:g}{decay})"
        if self.name == "momentum":
            return f"momentum (server_lr {self.lr:g}, server_momentum {self.momentum:g}{decay})"
        betas = f"beta1 {self.beta1:g}" + (f", beta2 {self.beta2:g}" if self.name != "adagrad" else "")
        return f"{self.name} (server_lr {self.lr:g}, {betas}, tau {self.tau:g}{decay})"

    def apply(self, weights: Mapping[str, np.ndarray], proposed: Mapping[str, np.ndarray],
              mean_delta: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The next global model: x_t = `weights`, x' = `proposed` (the server rule's new_global),
        Delta_t = `mean_delta` (the folded clients' delta the rule was given; None: the whole step
        x' - x_t is taken as Delta_t, R_t = 0)."""
        if self.is_identity:
            self.steps += 1
            return dict(proposed)
        lr = self.step_size()
        self.steps += 1
        out = {}
        for name, x in weights.items():
            x64 = np.asarray(x, dtype=np.float64)
            step = np.asarray(proposed[name], dtype=np.float64) - x64
            delta = step if mean_delta is None else np.asarray(mean_delta[name], dtype=np.float64)
            rule_own = step - delta  # R_t: a dual rule's H (float rounding for the others)
            out[name] = (x64 + lr * self._direction(name, delta) + rule_own).astype(np.float32)
        return out

    def _direction(self, name: str, delta: np.ndarray) -> np.ndarray:
        if self.name == "sgd":
            return delta
        m = self.m.get(name)
        if m is None:
            m = np.zeros_like(delta)
        if self.name == "momentum":
            self.m[name] = m = self.momentum * m + delta
            return m
        self.m[name] = m = self.beta1 * m + (1.0 - self.beta1) * delta
        v = self.v.get(name)
        if v is None:
            v = np.full_like(delta, self.tau ** 2)
        square = delta * delta
        if self.name == "adagrad":
            v = v + square
        elif self.name == "adam":
            v = self.beta2 * v + (1.0 - self.beta2) * square
        else:  # yogi
            v = v - (1.0 - self.beta2) * square * np.sign(v - square)
        self.v[name] = v
        return m / (np.sqrt(v) + self.tau)

    # checkpoint ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What the checkpoint keeps: the optimizer's name, its steps (which also set a decayed step
        size) and its moments."""
        if self.name == "sgd":
            return {"name": "sgd", "steps": self.steps}
        return {"name": self.name, "steps": self.steps, "m": self.m, "v": self.v}

    def load_state(self, state: Mapping[str, Any], specs: Mapping[str, tuple[int, ...]]) -> None:
        """Restore the moments of a checkpoint. A checkpoint without them (from before server optimizers,
        or of another optimizer) starts this one from zero moments, and the log says so."""
        if not state:
            if self.name != "sgd":
                log.warning("the checkpoint holds no server optimizer state: %s starts with zero moments",
                            self.describe())
            return
        if state.get("name") != self.name:
            log.warning("the checkpoint's server optimizer was %s; %s starts with zero moments",
                        state.get("name"), self.describe())
            return
        self.steps = int(state.get("steps", 0))
        for key in ("m", "v"):
            arrays = {n: np.asarray(a, dtype=np.float64) for n, a in (state.get(key) or {}).items()}
            wrong = {n: a.shape for n, a in arrays.items() if n not in specs or tuple(a.shape) != tuple(specs[n])}
            if wrong:
                raise ValueError(f"the checkpoint's server optimizer moments {key} do not fit the model: {wrong}")
            setattr(self, key, arrays)
