"""Local SGD with momentum and weight decay, the same update as torch.optim.SGD
(dampening 0, no Nesterov), written out so that the agent does not pay for
torch.optim: constructing any torch.optim optimizer imports torch._dynamo and
sympy, about 70 MB of resident memory on a device that has little to spare.

    g <- grad + weight_decay * theta
    b <- momentum * b + g            (b = g on the first step)
    theta <- theta - lr * b
"""

from __future__ import annotations

import torch


class LocalSGD:
    def __init__(self, params: list[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params, self.lr, self.momentum, self.weight_decay = params, lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad.add(p, alpha=self.weight_decay) if self.weight_decay else p.grad
            if self.momentum:
                if self.buffers[i] is None:
                    self.buffers[i] = g.detach().clone()
                else:
                    self.buffers[i].mul_(self.momentum).add_(g)
                g = self.buffers[i]
            p.add_(g, alpha=-self.lr)
