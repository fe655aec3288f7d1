"""The small interface through which every algorithm plugs into the one local
training loop (`edge_agent.training.train_locally`) and the one aggregator
(`broker_coordinator.aggregation.streaming.StreamingMean`).

Client side, per round, in the order the loop calls them:
    local_epochs(E) -> E'                 an algorithm may shorten the round (DR-SAM's tau rule)
    loss_function(labels) -> loss_fn      cross-entropy, or a loss that knows the local labels
    begin(model, global, steps, n)     remember what the round started from
    per mini-batch, at step s:
        wants_clean_gradient(s)           pass 1 at theta? (False only for CPU-sized SAM reuse steps)
        perturbation(s, params, loss)     after pass 1: SAM's eps, or None for plain descent
        observe_perturbed(s, loss, loss_eps)   after pass 2 at theta + eps (SAM family)
        adjust_gradients(s, params)       add the algorithm's terms to p.grad (before clipping)
    end(params) -> metrics                scalars reported with the update
    extra_tensors() -> {name: array}      tensors sent beside the delta ("extra.<name>")
    committed(sent)                       the update as the server decodes it, once it is delivered:
                                          state the server mirrors (FedDyn's dual) is set from this

Server side, per round:
    start_round(round_no, population)     population = devices that could have been asked
    pace(damping, delay)                  buffered mode, before new_global: the factor the engine applied
                                          to the mean delta and the mean staleness of its updates
    weight(num_samples, metrics)          how much one delta counts in the weighted mean
    observe(device, num_samples, metrics) every accepted update, for server state (signals)
    new_global(global, mean_delta, mean_extras)  the server rule; extras are averaged uniformly
    broadcast() / broadcast_tensors()     scalars sent with the tasks / tensors sent with the model
    state() / load_state(state)           the server's aggregate, checkpointed after every round

Algorithm state that must survive restarts lives in `self.state` on the
client (a DeviceState section, saved by the agent once per round) and in the
ServerRule object on the coordinator (one aggregate, never one copy per client).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

Scalar = int | float | str | bool
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Tensors = list[torch.Tensor]
EXTRA_PREFIX = "extra."


# --- small vector helpers over lists of tensors (one entry per parameter) -------------
def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum(torch.sum(x * y) for x, y in zip(a, b)))


def norm(a: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.sum(x * x)) for x in a))


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], b_norm: float | None = None) -> float:
    denominator = norm(a) * (norm(b) if b_norm is None else b_norm)
    return dot(a, b) / denominator if denominator > 0 else 0.0


def grads_of(params: Sequence[torch.Tensor]) -> Tensors:
    return [p.grad.detach().clone() for p in params]


def to_numpy(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [t.detach().numpy().copy() for t in tensors]


def from_numpy(arrays: Sequence[np.ndarray]) -> Tensors:
    return [torch.from_numpy(np.asarray(a, dtype=np.float32).copy()) for a in arrays]


def hp(hparams: Mapping[str, Scalar], defaults: Mapping[str, Scalar], name: str) -> float:
    return float(hparams.get(name, defaults[name]))


class ClientRule:
    """Plain local SGD: one forward-backward per mini-batch, nothing added."""

    def __init__(self, hparams: Mapping[str, Scalar], broadcast: Mapping[str, Scalar], state: dict[str, Any],
                 tensors: Mapping[str, np.ndarray] | None = None):
        self.hparams = dict(hparams)
        self.broadcast = dict(broadcast)
        self.state = state  # persisted by the agent between rounds and restarts
        self.tensors = dict(tensors or {})  # broadcast tensors, e.g. FedSMOO's global perturbation

    def local_epochs(self, epochs: int) -> int:
        return epochs

    def loss_function(self, labels: torch.Tensor) -> LossFn:
        return torch.nn.CrossEntropyLoss()

    def begin(self, model: torch.nn.Module, global_params: Tensors, total_steps: int, num_samples: int) -> None:
        self.param_names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.global_params = global_params
        self.total_steps = total_steps
        self.num_samples = num_samples

    def wants_clean_gradient(self, step: int) -> bool:
        return True

    def perturbation(self, step: int, params: Tensors, loss: float | None) -> Tensors | None:
        return None

    def observe_perturbed(self, step: int, loss: float | None, loss_perturbed: float) -> None:
        pass

    def adjust_gradients(self, step: int, params: Tensors) -> None:
        pass

    def end(self, params: Tensors) -> dict[str, Scalar]:
        return {}

    def extra_tensors(self) -> dict[str, np.ndarray]:
        return {}

    def committed(self, sent: Mapping[str, np.ndarray]) -> None:
        """Called by the agent with the delta exactly as the server will decode it (after a lossy
        codec and error feedback), once the update is delivered. `end` has already stored state
        from the local float32 delta (what an in-process run without a codec uses); a rule whose
        state the server mirrors replaces it here, so the two sides agree."""


class ServerRule:
    """Size-weighted mean of client deltas added to the global model (FedAvg)."""

    def __init__(self, hparams: Mapping[str, Scalar]):
        self.hparams = dict(hparams)
        self.round = 0
        self.population = 0
        self.damping, self.delay = 1.0, 0.0  # see pace

    def start_round(self, round_no: int, population: int) -> None:
        self.round, self.population = round_no, population
        self.damping, self.delay = 1.0, 0.0

    def pace(self, damping: float, delay: float) -> None:
        """Buffered mode: the step's `mean_delta` is the fold's mean times `damping` (FedBuff's
        staleness factor, <= 1), and its updates were trained `delay` versions ago on average
        (sync rounds: 1 and 0). A rule with state fed by every step reads these."""
        self.damping, self.delay = damping, delay

    def weight(self, num_samples: int, metrics: Mapping[str, Scalar]) -> float:
        """n_k (default), or 1 with hparam weighting = "uniform" (the FedDyn / FedSMOO papers' mean)."""
        return 1.0 if self.hparams.get("weighting", "size") == "uniform" else float(num_samples)

    def observe(self, device: str, num_samples: int, metrics: Mapping[str, Scalar]) -> None:
        pass

    def extra_specs(self, model_specs: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Shapes of the extra tensors each client sends beside its delta (names start with `extra.`)."""
        return {}

    def new_global(self, global_params: Mapping[str, np.ndarray], mean_delta: Mapping[str, np.ndarray],
                   mean_extras: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return {name: global_params[name] + mean_delta[name] for name in global_params}

    def broadcast(self) -> dict[str, Scalar]:
        return {}

    def broadcast_tensors(self) -> dict[str, np.ndarray]:
        """Tensors released with the model (names start with `extra.`)."""
        return {}

    def state(self) -> dict[str, Any]:
        """What must survive a coordinator restart (checkpointed after every round)."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        pass
