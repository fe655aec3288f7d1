"""The small interface through which every algorithm plugs into the one local
training loop (`edge_agent.training`) and the one aggregator
(`broker_coordinator.aggregation`).

Client side, per round, in the order the loop calls them:
    begin(model, global_params)     remember what the round started from
    compute_gradients(...)          fill p.grad for one mini-batch, return the loss
    adjust_gradients(params)        add the algorithm's terms to p.grad (before clipping)
    end(model) -> metrics           scalars reported with the update

Server side, per round:
    weight(num_samples, metrics)    how much one update counts in the average
    new_global(global, mean_delta)  the server rule applied to the weighted mean delta
    broadcast()                     scalars sent with the next round's tasks
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

Scalar = int | float | str | bool
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ClientRule:
    """Plain local SGD: one forward-backward per mini-batch, nothing added."""

    def __init__(self, hparams: Mapping[str, Scalar], broadcast: Mapping[str, Scalar], state: dict[str, Any]):
        self.hparams = dict(hparams)
        self.broadcast = dict(broadcast)
        self.state = state  # persisted by the agent between rounds and restarts

    def begin(self, model: torch.nn.Module, global_params: list[torch.Tensor]) -> None:
        self.global_params = global_params

    def compute_gradients(self, model: torch.nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = loss_fn(model(x), y)
        loss.backward()
        return float(loss.detach())

    def adjust_gradients(self, params: list[torch.Tensor]) -> None:
        pass

    def end(self, model: torch.nn.Module) -> dict[str, Scalar]:
        return {}


class ServerRule:
    """Weighted mean of client deltas added to the global model."""

    def __init__(self, hparams: Mapping[str, Scalar]):
        self.hparams = dict(hparams)

    def weight(self, num_samples: int, metrics: Mapping[str, Scalar]) -> float:
        return float(num_samples)

    def new_global(self, global_params: Mapping[str, np.ndarray], mean_delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: global_params[name] + mean_delta[name] for name in global_params}

    def broadcast(self) -> dict[str, Scalar]:
        return {}

    def state(self) -> dict[str, Any]:
        """What must survive a coordinator restart (checkpointed after every round)."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        pass
