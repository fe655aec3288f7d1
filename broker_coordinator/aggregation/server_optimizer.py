"""Server optimizers: the FedOpt family (Reddi et al., ICLR 2021, "Adaptive Federated Optimization")
and server momentum (FedAvgM, Hsu et al. 2019), applied to every algorithm's server rule.

The algorithm's server rule proposes the next global model x' = new_global(x, mean delta, extras);
its step is the pseudo-gradient (Reddi et al.'s Delta_t, a descent direction: clients' models minus x)

    Delta_t = x' - x_t

and the server optimizer turns it into the step actually taken, per coordinate:

    sgd       x_{t+1} = x_t + eta * Delta_t
    momentum  m_t = mu * m_{t-1} + Delta_t;                            x_{t+1} = x_t + eta * m_t
    adagrad   m_t = b1 * m_{t-1} + (1 - b1) * Delta_t;   v_t = v_{t-1} + Delta_t^2
    adam      m_t as adagrad;                            v_t = b2 * v_{t-1} + (1 - b2) * Delta_t^2
    yogi      m_t as adagrad;                            v_t = v_{t-1} - (1 - b2) * Delta_t^2 * sign(v_{t-1} - Delta_t^2)
              (adaptive ones)                            x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)

with m_{-1} = 0 and v_{-1} = tau^2 (Reddi et al.'s Algorithm 2 asks v_{-1} >= tau^2), and no bias
correction (their Algorithm 2 has none). Parameters, [rounds] keys with their defaults: server_optimizer
"sgd"; server_lr eta (unset: 1.0 for sgd, 1 - mu for momentum, 0.01 for adam and yogi, 0.1 for
adagrad: `RoundSettings.server_step_size`); server_momentum mu 0.9; beta1 b1 0.9; beta2 b2 0.99;
tau 1e-3. sgd with eta 1 returns x' itself: the server rule alone, bit for bit (today's behaviour).

The engine applies it once per applied model: per round (sync, flat or in sites) and per version
(buffered). What it sees is the server rule's whole step: for FedDyn and DynSAM that includes the
server dual H (x' - x = mean delta + H), so momentum there accumulates a step that already
accumulates past deltas (docs/ALGORITHMS.md, "Server optimizers"). Its moments are checkpointed
beside the server rule's state (`Checkpoint.server_optimizer`) and restored on resume.
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
                 beta2: float = 0.99, tau: float = 1e-3) -> None:
        if name not in SERVER_OPTIMIZERS:
            raise ValueError(f"server_optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {name!r}")
        self.name, self.lr, self.momentum = name, float(lr), float(momentum)
        self.beta1, self.beta2, self.tau = float(beta1), float(beta2), float(tau)
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.steps = 0  # steps taken (rounds or buffered versions that trained)

    @classmethod
    def of(cls, settings: RoundSettings) -> ServerOptimizer:
        return cls(settings.server_optimizer, settings.server_step_size(), settings.server_momentum,
                   settings.beta1, settings.beta2, settings.tau)

    @property
    def is_identity(self) -> bool:
        """sgd at eta 1: the server rule's model, untouched."""
        return self.name == "sgd" and self.lr == 1.0

    def describe(self) -> str:
        if self.name == "sgd":
            return f"sgd (server_lr {self.lr:g})"
        if self.name == "momentum":
            return f"momentum (server_lr {self.lr:g}, server_momentum {self.momentum:g})"
        betas = f"beta1 {self.beta1:g}" + (f", beta2 {self.beta2:g}" if self.name != "adagrad" else "")
        return f"{self.name} (server_lr {self.lr:g}, {betas}, tau {self.tau:g})"

    def apply(self, weights: Mapping[str, np.ndarray], proposed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The next global model: x_t = `weights`, x' = `proposed` (the server rule's new_global)."""
        self.steps += 1
        if self.is_identity:
            return dict(proposed)
        out = {}
        for name, x in weights.items():
            x64 = np.asarray(x, dtype=np.float64)
            delta = np.asarray(proposed[name], dtype=np.float64) - x64
            out[name] = (x64 + self.lr * self._direction(name, delta)).astype(np.float32)
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
        """What the checkpoint keeps: the optimizer's name, its steps and its moments."""
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
