"""Evaluate the global model on the coordinator's held-out test set."""

from __future__ import annotations

import torch
from torch import nn

from models.datasets import Dataset


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, batch_size: int = 1000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss)."""
    model.eval()
    correct, loss_sum = 0, 0.0
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for start in range(0, len(data), batch_size):
        x = torch.from_numpy(data.x[start:start + batch_size])
        y = torch.from_numpy(data.y[start:start + batch_size])
        logits = model(x)
        loss_sum += float(loss_fn(logits, y))
        correct += int((logits.argmax(dim=1) == y).sum())
    return correct / len(data), loss_sum / len(data)
