"""Shared machinery of the SAM family (FedSAM, FedSMOO, DR-SAM and ours): the
ascent step and its CPU-sized variant. Not an algorithm by itself.

SAM (Foret et al., ICLR 2021), per mini-batch:
    g = grad L(theta);  eps = rho * d / ||d||  with d = g (or an algorithm's corrected d);
    descend with grad L(theta + eps).
CPU-sized modes (`sam_every`):
  k > 1  LookSAM-like: eps is recomputed from a fresh pass 1 only every k-th step
         and reused in between; a round costs about (1 + 1/k) x SGD.
  k = 0  free ascent: eps follows the previous step's descent gradient
         grad L(theta_{s-1} + eps_{s-1}) (as Momentum-SAM / SAF use past gradients),
         so only step 0 needs a pass at theta; a round costs (K + 1)/K x SGD.
"""

from __future__ import annotations

import torch

from .base import ClientRule, Tensors, grads_of, norm


class SAMClient(ClientRule):
    def radius(self, step: int) -> float:
        return float(self.hparams.get("rho", 0.05))

    def begin(self, model, global_params: Tensors, total_steps: int, num_samples: int) -> None:
        super().begin(model, global_params, total_steps, num_samples)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def sam_every(self) -> int:
        return max(0, int(self.hparams.get("sam_every", 1)))

    def fresh_ascent(self, step: int) -> bool:
        k = self.sam_every()
        return step % k == 0 if k else step == 0

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
        elif self.sam_every() == 0:  # free ascent along the previous descent gradient
            scale = self.radius(step) / (norm(self.previous) + 1e-12)
            self.eps = [g * scale for g in self.previous]
        return self.eps

    def observe_perturbed(self, step: int, loss: float | None, loss_perturbed: float) -> None:
        if self.sam_every() == 0:
            self.previous = grads_of(self.params)

    def after_ascent(self, step: int, eps: Tensors) -> None:
        pass


def zeros_like(params: Tensors) -> Tensors:
    return [torch.zeros_like(p) for p in params]
