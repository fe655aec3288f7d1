"""Buffered mode's staleness rule (FedBuff, Nguyen et al., AISTATS 2022) and its settings check.

An update trained on model version v that arrives while the server is at
version V has staleness s = V - v. It is accepted while s <= S
(`max_staleness`) and counts with the factor
    inverse_sqrt: 1 / sqrt(1 + s)     (FedBuff's choice)
    constant:     1                   (staleness ignored, as long as s <= S)
Older updates are dropped with a reason (`too_stale`); see `buffered.py` for
how the factor enters the fold, and `round_settings.check_buffered` for the keys.
"""

from __future__ import annotations

import math

from broker_coordinator.settings.choices import STALENESS_WEIGHTS


def staleness_factor(kind: str, staleness: int) -> float:
    """The weight of an update `staleness` versions old (staleness >= 0)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if kind == "inverse_sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if kind == "constant":
        return 1.0
    raise ValueError(f"staleness_weight must be one of {', '.join(STALENESS_WEIGHTS)}, got {kind!r}")
