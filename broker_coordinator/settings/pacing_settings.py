"""The `[pacing]` section: when the coordinator opens rounds, and when it lets the fleet rest.

    [pacing]
    interval = "10m"         # from one round's start to the next: "30s", "10m", "2h", or seconds; 0 = back to back
    patience = 10            # evaluations without improvement before the federation rests; 0 = never rests
    min_improvement = 0.001  # how much the served model's score must beat its best to count (0.001 = 0.1 points)
    new_data = 0.2           # a resting federation resumes when its devices hold this much more data; 0 = never

A resting federation also resumes on `broker-coordinator resume`. `simulate` and the benchmarks run
rounds back to back: pacing is the service's (`broker-coordinator run`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(value: Any, key: str) -> float:
    """A duration as the operator wrote it ("10m", "2h", "90s", or a number of seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and (match := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", value)):
        number = float(match.group(1)) * UNITS.get(match.group(2) or "s", 1.0)
    else:
        raise ValueError(f"{key} must be a duration such as \"30s\", \"10m\", \"2h\" or a number of seconds, "
                         f"got {value!r}")
    if not 0 <= number <= 30 * 86400:
        raise ValueError(f"{key} must be between 0 and 30 days, got {value!r}")
    return number


@dataclass
class PacingSettings:
    interval: Any = "10m"  # from one round's start to the next: "30s", "10m", "2h", or seconds; 0 = back to back
    patience: int = 10  # evaluations without improvement of the served model before the federation rests; 0 = never
    min_improvement: float = 0.001  # the served model's score must beat its best by this much (0.001 = 0.1 points)
    new_data: float = 0.2  # a resting federation resumes when its devices hold this fraction more samples; 0 = never

    @property
    def interval_seconds(self) -> float:
        return seconds(self.interval, "interval")

    def validate(self) -> None:
        self.interval_seconds  # noqa: B018 (raises ValueError naming the key)
        if self.patience < 0:
            raise ValueError(f"patience must be 0 (never rest) or a number of evaluations, got {self.patience}")
        if not 0 <= self.min_improvement < 1:
            raise ValueError(f"min_improvement must be in [0, 1), got {self.min_improvement}")
        if not 0 <= self.new_data <= 100:
            raise ValueError(f"new_data must be a fraction of the devices' samples (0 = never), got {self.new_data}")
