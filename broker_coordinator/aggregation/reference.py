"""A trusted direction for the round, from a small dataset the operator holds.

FLTrust (Cao et al., NDSS 2021): the server trains the current global model
for a few steps on a small "root" set it trusts and takes the resulting delta
as the reference direction; a device's delta that points away from it
(cosine <= 0) is left out of the round. Under strongly non-IID data the
round's own median is a weak reference (honest deltas are nearly orthogonal
to one another); a trained reference is not. It needs labelled data on the
coordinator that is not the test set (`[federation] root_data`): with it the
default (`[fold] reference = "auto"`) uses it, without it the round's median.
The streaming folds use the same update to score each device's (`[fold]
root_trust`, see `RobustRound._trusted`), at the centre and, sent with the
site task, at the sites.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from edgefl_models.architectures import build_model, get_weights, set_weights
from edgefl_models.datasets import Dataset
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import SiteTask, decode_trust
from edgefl_protocol.sparse_delta import SparseDelta

log = logging.getLogger(__name__)


def root_step(arch: str, weights: Mapping[str, np.ndarray], root: Dataset, lr: float, epochs: int = 2,
              batch_size: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """The delta of `epochs` of plain SGD on `root` from `weights`."""
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
    return {n: (after[n] - weights[n]).astype(np.float32) for n in weights}


class RootUpdates:
    """The root update of each model version, trained once however many folds and site tasks ask."""

    def __init__(self, arch: str, root: Dataset) -> None:
        self.arch, self.root = arch, root
        self._last: tuple[int, dict[str, np.ndarray]] | None = None  # (model version, its root update)

    def of(self, version: int, weights: Mapping[str, np.ndarray], lr: float, seed: int) -> dict[str, np.ndarray]:
        if self._last is None or self._last[0] != version:
            self._last = (version, root_step(self.arch, weights, self.root, lr, seed=seed))
        return self._last[1]


def dot_with(delta: Mapping[str, np.ndarray], root: np.ndarray, names: list[str]) -> float:
    """<delta, root>, `root` flattened in the order of `names` (a top-k delta from its kept values)."""
    if isinstance(delta, SparseDelta) and delta.names == tuple(names):
        dot = float(np.dot(delta.values.astype(np.float64), root[delta.positions]))
    else:
        dot, start = 0.0, 0
        for name in names:
            values = np.ravel(np.asarray(delta[name], dtype=np.float32))
            dot += float(np.dot(values, root[start:start + len(values)]))
            start += len(values)
    return dot


def flattened(tensors: Mapping[str, np.ndarray], names: list[str]) -> np.ndarray:
    return np.concatenate([np.ravel(tensors[n]) for n in names]).astype(np.float32)


def carried_root_update(site_task: SiteTask, specs: Mapping[str, tuple[int, ...]]) -> Callable[[list[str]], np.ndarray] | None:
    """A site worker's root update under root_trust: the one its site task carries. None when it is
    missing or unusable: the round is folded without the trust score, and the operator told."""
    try:
        update = decode_trust(site_task, specs)
    except Rejected as exc:
        update, why = None, f"unusable ({exc})"
    else:
        why = "missing"
    if update is None:
        log.error("round %d: root_trust is on but the site task's root update is %s; folding without the trust "
                  "score", site_task.round, why)
        return None
    return lambda names: flattened(update, names)
