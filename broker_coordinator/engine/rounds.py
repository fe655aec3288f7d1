"""One round as an explicit state machine.

    OPEN -> COLLECTING -> CLOSED -> AGGREGATED -> EVALUATED -> CHECKPOINTED
                     \\-> ABANDONED   (no quorum at the deadline, or shutdown;
                                      the global model is unchanged)

OPEN: cohort chosen, model and tasks published. COLLECTING: updates are
validated and folded in as they arrive. CLOSED: every selected device answered,
or the deadline passed with at least the quorum.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from broker_coordinator.aggregation.fold import Fold
from broker_coordinator.aggregation.streaming import StreamingMean


class RoundFailed(Exception):
    """A round found no quorum in any of its attempts."""


class RoundState(str, Enum):
    OPEN = "open"
    COLLECTING = "collecting"
    CLOSED = "closed"
    AGGREGATED = "aggregated"
    EVALUATED = "evaluated"
    CHECKPOINTED = "checkpointed"
    ABANDONED = "abandoned"


NEXT: dict[RoundState, set[RoundState]] = {
    RoundState.OPEN: {RoundState.COLLECTING, RoundState.ABANDONED},
    RoundState.COLLECTING: {RoundState.CLOSED, RoundState.ABANDONED},
    RoundState.CLOSED: {RoundState.AGGREGATED},
    RoundState.AGGREGATED: {RoundState.EVALUATED},
    RoundState.EVALUATED: {RoundState.CHECKPOINTED},
    RoundState.CHECKPOINTED: set(),
    RoundState.ABANDONED: set(),
}


@dataclass
class Round:
    number: int
    attempt: int
    cohort: set[str]
    deadline: float
    base_version: int
    aggregate: Fold  # device updates, or a site's partials; maybe wrapped in stages (damping)
    state: RoundState = RoundState.OPEN
    started: float = field(default_factory=time.time)
    answered: set[str] = field(default_factory=set)
    device_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    rejected: Counter[str] = field(default_factory=Counter)
    refused: dict[str, str] = field(default_factory=dict)  # device -> reason it gave for refusing the task
    weights_clipped: int = 0
    bytes_up: int = 0
    reason: str = ""
    train: bool = True  # False: an evaluation-only round (devices report, the model stays)
    evaluations: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # device -> score, loss, count
    evaluated: dict[str, int] = field(default_factory=dict)  # device -> the model version it evaluated
    # tensors an algorithm sends beside the delta (FedSMOO's mu), averaged uniformly over the round
    extras: StreamingMean | None = None
    shares: dict[str, int] = field(default_factory=dict)  # sites: site -> devices it selects (0: all)

    def move(self, new: RoundState, reason: str = "") -> None:
        if new not in NEXT[self.state]:
            raise RuntimeError(f"round {self.number}: illegal transition {self.state.value} -> {new.value}")
        self.state = new
        self.reason = reason or self.reason

    @property
    def counted(self) -> int:
        """Answers that count towards the quorum: folded updates, or evaluation reports."""
        return self.aggregate.count if self.train else len(self.evaluations)

    @property
    def complete(self) -> bool:
        """Every selected device has answered, with an update or a refusal."""
        return self.answered | set(self.refused) >= self.cohort
