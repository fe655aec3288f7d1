"""FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks").

Client:  minimize L_k(theta) + mu/2 ||theta - theta_t||^2, i.e. per mini-batch
         g <- grad L_k(theta) + mu * (theta - theta_t)
Server:  theta_{t+1} = theta_t + sum_k p_k (theta_k - theta_t),   p_k = n_k / sum_j n_j

Parameters: mu = 0.1 (the peer measurement's value), weighting = "size".
"""

from __future__ import annotations

import torch

from .base import ClientRule, ServerRule, Tensors, hp

NAME = "fedprox"
DEFAULT_HPARAMS: dict[str, float | str] = {"mu": 0.1, "weighting": "size"}


class Client(ClientRule):
    def adjust_gradients(self, step: int, params: Tensors) -> None:
        mu = hp(self.hparams, DEFAULT_HPARAMS, "mu")
        with torch.no_grad():
            for p, g in zip(params, self.global_params):
                p.grad.add_(p - g, alpha=mu)


class Server(ServerRule):
    pass
