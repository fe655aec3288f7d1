"""FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of
Deep Networks from Decentralized Data").

Client:  E epochs of local SGD (optionally with momentum) from the global model theta_t:
         theta <- theta - lr * grad L_k(theta)
Server:  theta_{t+1} = theta_t + sum_k p_k (theta_k - theta_t),   p_k = n_k / sum_j n_j

Parameters: `weighting` = "size" (default, p_k ~ n_k) or "uniform" (p_k = 1/|P|),
plus the shared local-training ones (lr, momentum, batch size, epochs,
weight decay, grad clip).
"""

from __future__ import annotations

from .base import ClientRule, ServerRule

NAME = "fedavg"
DEFAULT_HPARAMS: dict[str, float | str] = {"weighting": "size"}


class Client(ClientRule):
    pass


class Server(ServerRule):
    pass
