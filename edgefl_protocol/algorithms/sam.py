"""Shared machinery of the SAM family (FedSAM, FedSMOO, DR-SAM and ours): the
ascent step and its CPU-sized variant. Not an algorithm by itself.

SAM (Foret et al., ICLR 2021), per mini-batch:
    g = grad L(theta);  eps = rho * d / ||d||  with d = g (or an algorithm's corrected d);
    descend with grad L(theta + eps).
CPU-sized mode (`sam_every` = k > 1, LookSAM-like): eps is recomputed from a
fresh pass 1 only every k-th step and reused in between, so a reuse step
costs one forward-backward (at theta + eps) and a round costs about
(1 + 1/k) x SGD instead of 2 x.
"""

from __future__ import annotations

import torch

from .base import ClientRule, Tensors, grads_of, norm


class SAMClient(ClientRule):
    def radius(self, step: int) -> float:
        return float(self.hparams.get("rho", 0.05))

    def sam_every(self) -> int:
        return max(1, int(self.hparams.get("sam_every", 1)))

    def fresh_ascent(self, step: int) -> bool:
        return step % self.sam_every() == 0

    def ascent_direction(self, step: int, grads: Tensors) -> Tensors:
        return grads

    def wants_clean_gradient(self, step: int) -> bool:
        return self.fresh_ascent(step) or getattr(self, "eps", None) is None

    def perturbation(self, step: int, params: Tensors, loss: float | None) -> Tensors | None:
        if loss is not None:  # fresh pass 1 happened: new ascent direction
            direction = self.ascent_direction(step, grads_of(params))
            scale = self.radius(step) / (norm(direction) + 1e-12)
            self.eps = [d * scale for d in direction]
            self.after_ascent(step, self.eps)
        return self.eps

    def after_ascent(self, step: int, eps: Tensors) -> None:
        pass


def zeros_like(params: Tensors) -> Tensors:
    return [torch.zeros_like(p) for p in params]
