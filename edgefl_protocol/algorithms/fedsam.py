"""FedSAM (Qu et al., ICML 2022, "Generalized Federated Learning via Sharpness
Aware Minimization"; Caldarola et al., ECCV 2022).

Client:  per mini-batch  g = grad L_k(theta);  eps = rho * g / ||g||;
         theta <- theta - lr * grad L_k(theta + eps)
         (CPU-sized: eps refreshed every `sam_every` steps, reused in between)
Server:  theta_{t+1} = theta_t + sum_k p_k (theta_k - theta_t),   p_k = n_k / sum_j n_j

Parameters: rho = 0.05, sam_every = 1 (full SAM), weighting = "size".
"""

from __future__ import annotations

from .base import ServerRule
from .sam import SAMClient

NAME = "fedsam"
DEFAULT_HPARAMS: dict[str, float | str] = {"rho": 0.05, "sam_every": 1, "weighting": "size"}


class Client(SAMClient):
    pass


class Server(ServerRule):
    pass
