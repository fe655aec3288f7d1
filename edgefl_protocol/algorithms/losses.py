"""Local losses that know the client's own label distribution.

Balanced softmax (Ren et al., NeurIPS 2020; the logit adjustment of Menon et
al., ICLR 2021, used for federated label skew as in FedLC, Zhang et al., ICML
2022): train on logits + log(prior_c), where prior_c is the share of class c
in this client's data; predict with the raw logits. A client that holds two
classes then stops pushing every other class's logit down, which is most of
what makes its update disagree with the federation's under label skew. The
prior uses add-`smoothing` counts so an absent class keeps a finite logit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BalancedSoftmaxLoss(nn.Module):
    def __init__(self, labels: torch.Tensor, smoothing: float = 1.0):
        super().__init__()
        self.labels = labels
        self.smoothing = smoothing
        self.log_prior: torch.Tensor | None = None

    def prior_for(self, num_classes: int) -> torch.Tensor:
        if self.log_prior is None or self.log_prior.numel() != num_classes:
            counts = torch.bincount(self.labels, minlength=num_classes).to(torch.float32) + self.smoothing
            self.log_prior = torch.log(counts / counts.sum())
        return self.log_prior

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits + self.prior_for(logits.shape[1]), target)
