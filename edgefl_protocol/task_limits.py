"""The ranges of training settings a device will run, in one place.

The agent refuses a task outside them (a hostile or mistaken task must not be
obeyed); the coordinator checks its own settings against the same ranges at
start-up, so that it never sends a task every device would refuse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .errors import Rejected

MAX_LOCAL_EPOCHS = 100
MAX_BATCH_SIZE = 65536
MAX_LR = 10.0

# (hparam name, default, check, what the range is)
LIMITS: tuple[tuple[str, float, object, str], ...] = (
    ("local_epochs", 2, lambda v: v == int(v) and 0 <= v <= MAX_LOCAL_EPOCHS,
     f"local_epochs must be a whole number 0-{MAX_LOCAL_EPOCHS} (0 = chosen by each device)"),
    ("batch_size", 32, lambda v: v == int(v) and 1 <= v <= MAX_BATCH_SIZE, f"batch_size must be 1-{MAX_BATCH_SIZE}"),
    ("lr", 0.05, lambda v: 0 < v <= MAX_LR, f"lr must be in (0, {MAX_LR:g}]"),
    ("momentum", 0.0, lambda v: 0 <= v < 1, "momentum must be in [0, 1)"),
    ("weight_decay", 1e-3, lambda v: 0 <= v <= 1, "weight_decay must be in [0, 1]"),
    ("grad_clip", 10.0, lambda v: 0 <= v < math.inf, "grad_clip must be >= 0 and finite"),
)


def check_training(hparams: Mapping[str, object]) -> dict[str, float]:
    """The task's training settings as numbers, or Rejected('task_settings', what is out of range)."""
    values: dict[str, float] = {}
    for name, default, ok, message in LIMITS:
        raw = hparams.get(name, default)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise Rejected("task_settings", f"{name} must be a number, got {raw!r}")
        if not (math.isfinite(raw) or name == "grad_clip") or not ok(raw):  # type: ignore[operator]
            raise Rejected("task_settings", f"{message}; the task says {raw!r}")
        values[name] = float(raw)
    return values
