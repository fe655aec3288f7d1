"""Who trains this round.

- `random` (default): a uniform sample of the eligible devices.
- `stability` (DR-SAM, docs/DRSAM.md "Server side"): prefer devices whose last report had
  tau < 0.15 and gamma > 0.7, and devices with no history; at least half of the
  cohort is still drawn uniformly from all eligible devices so that hard
  non-IID devices are not starved.

Eligible means online and not busy (still training for an earlier task).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from broker_coordinator.settings.choices import POLICIES  # noqa: F401 (the policies this module implements)

STABLE_TAU, STABLE_GAMMA = 0.15, 0.7


def is_stable(metrics: Mapping[str, Any] | None) -> bool:
    if not metrics or "tau" not in metrics or "gamma" not in metrics:
        return True  # no history: eligible
    return float(metrics["tau"]) < STABLE_TAU and float(metrics["gamma"]) > STABLE_GAMMA


def select(policy: str, eligible: list[str], k: int, rng: random.Random,
           last_metrics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    eligible = sorted(eligible)
    k = min(k, len(eligible))
    if policy == "random":
        return sorted(rng.sample(eligible, k))
    if policy != "stability":
        raise ValueError(f"unknown selection policy {policy!r}; choose one of {', '.join(POLICIES)}")
    chosen = set(rng.sample(eligible, math.ceil(k / 2)))
    rest = [d for d in eligible if d not in chosen]
    stable = [d for d in rest if is_stable(last_metrics.get(d))]
    unstable = [d for d in rest if d not in stable]
    rng.shuffle(stable)
    rng.shuffle(unstable)
    chosen.update((stable + unstable)[: k - len(chosen)])
    return sorted(chosen)
