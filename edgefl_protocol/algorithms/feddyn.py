"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic
Regularization"), in the form of the FedSMOO paper's code (FL-Simulator).

Each client k keeps its own dual h_k (on the device, in its state): the sum of
its past local updates. The server keeps one aggregate H = (1/m) sum_k h_k over
all m clients, never one copy per client.

Client:  per mini-batch   g <- grad L_k(theta) + alpha * (theta - theta_t + h_k)
         after the round  h_k <- h_k + (theta_k - theta_t)
         (Acar's dual is -alpha * h_k: the local objective is
          L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta_t||^2)
Server:  H <- H + (|P|/m) * mean_{k in P}(theta_k - theta_t)
         theta_{t+1} = theta_t + mean_{k in P}(theta_k - theta_t) + H

Buffered mode (`pace`: the engine damped the mean by d, and its updates are s versions stale on
average). H still adds up what the devices' duals add up, the undamped mean (mean_delta / d), so
that H stays the mean of the h_k and vanishes where they balance. H enters the model as
H / (1 + s)^2: the model integrates H, which integrates the deltas, and the devices answer H only
about s versions later; a loop of two integrators with a delay stays stable at a gain that falls
with the square of the delay. Added whole, H overshot and the loss rose to 4-8 on digits with s
about 1.5 (bench/results/buffered_duals.json). Sync rounds have d = 1 and s = 0: FedDyn exactly.

A leaky dual (`dual_decay` beta < 1, off by default: beta = 1 is FedDyn). Every dual shrinks by beta
each round, present or not:  h_k <- beta h_k + [k in P] delta_k,  H <- beta H + (|P|/m) mean_P delta,
so H stays the mean of the h_k. The server broadcasts its `dual_clock` (how many rounds it has
decayed H); a device scales the h_k it stored at clock c_s by beta^(clock - c_s) before training, so
an absent device's dual decays as H assumed it did. A sum of past updates is a random walk once
they stop averaging out; the leak bounds it (docs/RESEARCH.md, "The default across settings").

Parameters: alpha = 0.1 (the paper code's `lamb`), weighting = "uniform" (the
paper's mean; "size" weights the mean by n_k and H's increment alike), dual_decay = 1.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..errors import Rejected
from .base import ClientRule, Scalar, ServerRule, Tensors, from_numpy, hp, to_numpy

NAME = "feddyn"
DEFAULT_HPARAMS: dict[str, float | str] = {"alpha": 0.1, "weighting": "uniform", "dual_decay": 1.0}


def dual_decay(hparams: Mapping[str, Scalar]) -> float:
    beta = float(hparams.get("dual_decay", 1.0))
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"dual_decay must be in (0, 1] (1: FedDyn's dual, no leak); got {beta}")
    return beta


class DualState:
    """The client's FedDyn dual h_k, loaded from and stored into the device state."""

    def load_dual(self, params: Tensors) -> None:
        stored = self.state.get("h")
        self.dual = from_numpy(stored) if stored is not None else [torch.zeros_like(p) for p in params]
        self.beta = dual_decay(self.hparams)
        clock = self.broadcast.get("dual_clock")
        if clock is not None and (isinstance(clock, bool) or not isinstance(clock, (int, float))
                                  or clock != int(clock) or clock < 0):
            raise Rejected("schema", f"broadcast dual_clock must be a whole number of rounds >= 0, got {clock!r}")
        if self.beta < 1.0 and clock is not None:
            # the rounds H decayed since this device's dual was last added to it
            missed = max(0, int(clock) - int(self.state.get("h_clock", clock)))
            with torch.no_grad():
                for h in self.dual:
                    h.mul_(self.beta ** missed)
            self.state["h_clock"] = int(clock) + 1  # the clock once this round's delta is in H

    def add_dual_correction(self, params: Tensors, alpha: float) -> None:
        with torch.no_grad():
            for p, g, h in zip(params, self.global_params, self.dual):
                p.grad.add_(p - g + h, alpha=alpha)

    def store_dual(self, params: Tensors) -> None:
        with torch.no_grad():
            self.state["h"] = to_numpy([self.beta * h + p - g for h, p, g in zip(self.dual, params, self.global_params)])

    def committed(self, sent) -> None:
        """h_k <- h_k + (the delta the server received): the server's H adds up exactly these, so
        with a lossy codec the client's dual must too, or h_k and H drift apart round after round."""
        super().committed(sent)
        if getattr(self, "dual", None) is not None:
            self.state["h"] = [self.beta * h.numpy() + np.asarray(sent[name], dtype=np.float32)
                               for h, name in zip(self.dual, self.param_names)]


class Client(DualState, ClientRule):
    def begin(self, model, global_params: Tensors, total_steps: int, num_samples: int) -> None:
        super().begin(model, global_params, total_steps, num_samples)
        self.load_dual(global_params)

    def adjust_gradients(self, step: int, params: Tensors) -> None:
        self.add_dual_correction(params, hp(self.hparams, DEFAULT_HPARAMS, "alpha"))

    def end(self, params: Tensors) -> dict[str, Scalar]:
        self.store_dual(params)
        return {}


class DualServer(ServerRule):
    """theta_{t+1} = theta_t + mean delta + H, with H the population mean of the client duals."""

    def __init__(self, hparams: Mapping[str, Scalar]):
        super().__init__({**DEFAULT_HPARAMS, **hparams})
        self.H: dict[str, np.ndarray] | None = None
        self.cohort_size = 0  # updates observed this round (start_round resets it)
        self.beta = dual_decay(self.hparams)
        self.clock = 0  # rounds H has decayed (leaky dual only)

    def new_global(self, global_params, mean_delta, mean_extras=None) -> dict[str, np.ndarray]:
        if self.H is None:
            self.H = {name: np.zeros_like(a, dtype=np.float64) for name, a in global_params.items()}
        share = self.cohort_size / max(self.population, self.cohort_size, 1) / max(self.damping, 1e-6)
        for name in self.H:
            self.H[name] *= self.beta
            self.H[name] += share * mean_delta[name]
        if self.beta < 1.0:
            self.clock += 1
        lag = 1.0 / (1.0 + max(self.delay, 0.0)) ** 2  # buffered: see the module's docstring
        return {name: (global_params[name] + mean_delta[name] + lag * self.H[name]).astype(np.float32)
                for name in global_params}

    def state(self) -> dict:
        return ({"H": self.H} if self.H is not None else {}) | ({"clock": self.clock} if self.beta < 1.0 else {})

    def load_state(self, state) -> None:
        if "H" in state:
            self.H = {name: np.asarray(a, dtype=np.float64) for name, a in state["H"].items()}
        self.clock = int(state.get("clock", 0))

    def broadcast(self) -> dict[str, Scalar]:
        return {"dual_clock": self.clock} if self.beta < 1.0 else {}

    def start_round(self, round_no: int, population: int) -> None:
        super().start_round(round_no, population)
        self.cohort_size = 0

    def observe(self, device: str, num_samples: int, metrics: Mapping[str, Scalar]) -> None:
        self.cohort_size += 1


class Server(DualServer):
    pass
