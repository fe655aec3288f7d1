"""FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of
Deep Networks from Decentralized Data").

Client: E epochs of local SGD from the global model theta_t.
Server: theta_{t+1} = theta_t + sum_k p_k (theta_k - theta_t),  p_k = n_k / sum_j n_j.

Parameters: none beyond the shared local-training ones (lr, momentum, batch
size, epochs, weight decay, grad clip).
"""

from __future__ import annotations

from .base import ClientRule, ServerRule

NAME = "fedavg"
DEFAULT_HPARAMS: dict[str, float] = {}


class FedAvgClient(ClientRule):
    pass


class FedAvgServer(ServerRule):
    pass
