"""What a federation learns to do: its task, the loss devices train with, and the metric it is judged by.

- classification: cross-entropy on integer labels; metric accuracy (higher is better).
- regression: MSE or MAE on float targets; the metric is the same error (lower is better).

The coordinator names the objective in every task, so devices train the loss
the operator chose, and every report names the metric instead of assuming accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .datasets import Dataset

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch is imported where a loss or an evaluation needs it, not here: the coordinator's device-management
# commands validate [federation] task and loss through Objective and stay quick (config.load_config)
TASKS = ("classification", "regression")
LOSSES = {"classification": ("cross_entropy",), "regression": ("mse", "mae")}
LossFn = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class Evaluation:
    metric: str
    score: float  # accuracy in [0, 1], or the mean error
    loss: float
    count: int


@dataclass(frozen=True)
class Objective:
    task: str = "classification"
    loss: str = "cross_entropy"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.loss not in LOSSES[self.task]:
            raise ValueError(f"a {self.task} task trains with {' or '.join(LOSSES[self.task])}, not {self.loss!r}")

    @classmethod
    def of(cls, task: str, loss: str = "") -> "Objective":
        """The objective for a task, with its default loss when `loss` is empty."""
        return cls(task, loss or LOSSES.get(task, ("",))[0])

    @property
    def metric(self) -> str:
        return "accuracy" if self.task == "classification" else self.loss

    @property
    def higher_is_better(self) -> bool:
        return self.task == "classification"

    def loss_function(self) -> LossFn:
        from torch import nn
        from torch.nn import functional as F
        if self.task == "classification":
            return nn.CrossEntropyLoss()
        error = F.mse_loss if self.loss == "mse" else F.l1_loss
        return lambda output, target: error(output.reshape(target.shape), target)

    def label_dtype(self) -> type:
        return np.int64 if self.task == "classification" else np.float32

    def evaluate(self, model: nn.Module, data: Dataset, batch_size: int = 1000) -> Evaluation:
        """The metric and the mean loss of `model` on `data` (NaN for empty data)."""
        import torch
        if len(data) == 0:
            return Evaluation(self.metric, float("nan"), float("nan"), 0)
        model.eval()
        loss_fn = self.loss_function()
        loss_sum, score_sum = 0.0, 0.0
        with torch.no_grad():
            for start in range(0, len(data), batch_size):
                x = torch.from_numpy(data.x[start:start + batch_size])
                y = torch.from_numpy(data.y[start:start + batch_size])
                output = model(x)
                loss_sum += float(loss_fn(output, y)) * len(y)
                if self.task == "classification":
                    score_sum += float((output.argmax(dim=1) == y).sum())
        score = score_sum / len(data) if self.task == "classification" else loss_sum / len(data)
        return Evaluation(self.metric, score, loss_sum / len(data), len(data))


def format_score(metric: str, score: float) -> str:
    """A score as people read it: accuracy in percent, errors as numbers, "n/a" when not measured."""
    if score != score:  # NaN
        return "n/a"
    return f"{100 * score:.2f}%" if metric == "accuracy" else f"{score:.4g}"
