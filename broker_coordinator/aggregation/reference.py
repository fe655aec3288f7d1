"""A trusted direction for the round, from a small dataset the operator holds.

FLTrust (Cao et al., NDSS 2021): the server trains the current global model
for a few steps on a small "root" set it trusts and takes the resulting delta
as the reference direction; a device's delta that points away from it
(cosine <= 0) is left out of the round. Under strongly non-IID data the
round's own median is a weak reference (honest deltas are nearly orthogonal
to one another); a trained reference is not. It needs labelled data on the
coordinator that is not the test set (`[federation] root_data`): with it the
default (`[fold] reference = "auto"`) uses it, without it the round's median.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from edgefl_models.architectures import build_model, get_weights, set_weights
from edgefl_models.datasets import Dataset


def root_direction(arch: str, weights: Mapping[str, np.ndarray], root: Dataset, names: list[str],
                   lr: float, epochs: int = 2, batch_size: int = 32, seed: int = 0) -> np.ndarray:
    """The flattened delta (in the order of `names`) of `epochs` of plain SGD on `root`."""
    model = build_model(arch)
    set_weights(model, dict(weights))
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    x_all, y_all = torch.from_numpy(root.x), torch.from_numpy(root.y)
    for _ in range(epochs):
        order = torch.randperm(len(root), generator=generator)
        for start in range(0, len(root), batch_size):
            index = order[start:start + batch_size]
            model.zero_grad()
            loss_fn(model(x_all[index]), y_all[index]).backward()
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p -= lr * p.grad
    after = get_weights(model)
    return np.concatenate([(after[n] - weights[n]).ravel() for n in names]).astype(np.float32)
