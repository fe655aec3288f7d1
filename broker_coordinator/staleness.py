"""Buffered mode's staleness rule (FedBuff, Nguyen et al., AISTATS 2022) and its settings check.

An update trained on model version v that arrives while the server is at
version V has staleness s = V - v. It is accepted while s <= S
(`max_staleness`) and counts with the factor
    inverse_sqrt: 1 / sqrt(1 + s)     (FedBuff's choice)
    constant:     1                   (staleness ignored, as long as s <= S)
Older updates are dropped with a reason (`too_stale`); see `buffered.py` for
how the factor enters the fold.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from edgefl_protocol import algorithms

if TYPE_CHECKING:
    from .round_settings import RoundSettings

STALENESS_WEIGHTS = ("inverse_sqrt", "constant")


def staleness_factor(kind: str, staleness: int) -> float:
    """The weight of an update `staleness` versions old (staleness >= 0)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if kind == "inverse_sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if kind == "constant":
        return 1.0
    raise ValueError(f"staleness_weight must be one of {', '.join(STALENESS_WEIGHTS)}, got {kind!r}")


def served_algorithms() -> list[str]:
    """Algorithms whose server rule (with default hyper-parameters) can fold stale updates."""
    return sorted(name for name, a in algorithms.ALGORITHMS.items()
                  if not a.server(dict(a.defaults)).asynchronous_refusal())


def check_buffered(settings: RoundSettings) -> None:
    """The ranges of [rounds] keys of mode = "buffered"; a ValueError names the key at fault. What
    buffered mode runs together with is `composition`'s to say."""
    checks = [
        (settings.buffer_size >= 1, "buffer_size must be >= 1 (accepted updates per applied version)"),
        (settings.max_staleness >= 0, "max_staleness must be >= 0 (versions an update may lag behind; "
                                      "0 accepts only updates trained on the current version)"),
        (settings.staleness_weight in STALENESS_WEIGHTS,
         f"staleness_weight must be one of {', '.join(STALENESS_WEIGHTS)}, got {settings.staleness_weight!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
