"""What the engine asks of a round's fold, whatever it folds (device updates or site partials) and
whatever wraps it (buffered damping, central DP).

A fold is given answers one at a time (`add`), gives the round's aggregate step once when the round
closes (`result`), and says what it did on the way (`report`): which updates it clipped, pulled
towards the centre, left out or held back, and how the step is paced. The round's record, the log
lines, the Prometheus counters and the server rule read the report and nothing else of the fold.

While the round is open, the verdicts a device's receipt carries (`engine/verdicts.py`) read the
fold's live records (`clipped`, `centered`, `gated`, `discounted`) and ask whether it still holds an update
undecided (`undecided`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

MEDIAN = "the round's median"  # gated_mean's direction, unless the root update is given


@dataclass
class FoldReport:
    """What a closed round's fold did, keyed by device (or "site S" for a site's partial)."""
    count: int  # device updates folded (a partial counts its devices)
    clipped: dict[str, tuple[float, float]] = field(default_factory=dict)  # (norm, bound) of norm-clipped ones
    centered: dict[str, tuple[float, float]] = field(default_factory=dict)  # (distance, radius) from the centre
    gated: dict[str, float] = field(default_factory=dict)  # cosine with `gated_by` of those left out
    # (share, why) of those folded below their full weight for what earlier rounds showed of them
    discounted: dict[str, tuple[float, str]] = field(default_factory=dict)
    disagreeing: dict[str, float] = field(default_factory=dict)  # median cosine of those flagged
    held_back: dict[str, float] = field(default_factory=dict)  # the scale a flagged bank-mate's sum got
    judged_kin: bool = False  # the fold judged with the engine's own consensus (its kin flags are this round's)
    unvoted: float | None = None  # the share of parameters the sign votes held still
    bounded: Counter[str] = field(default_factory=Counter)  # what sites and the centre bounded, by kind (sites)
    reports: int = 0  # devices whose evaluation partials carried (sites)
    bytes_down: int = 0  # model bytes the sites' devices say they received (sites)
    damping: float = 1.0  # buffered: sum n_k f(s_k) / sum n_k, the step's scale for staleness
    delay: float = 0.0  # buffered: the mean staleness of the step's updates
    released: dict[str, float] = field(default_factory=dict)  # central DP: what was released beside the step
    private: bool = False  # central DP: which device was clipped is not released
    floored: set[str] = field(default_factory=set)  # devices whose standing is at its floor (not root_trust's)
    gated_by: str = MEDIAN  # the direction the left-out updates pointed away from


class Fold(Protocol):
    """The common part of a round's folds; `add` takes what the topology's answers carry (a
    device's delta, or a site's partial and its sums)."""
    clipped: dict[str, tuple[float, float]]
    centered: dict[str, tuple[float, float]]
    gated: dict[str, float]
    discounted: dict[str, tuple[float, str]]

    @property
    def count(self) -> int: ...

    @property
    def center(self) -> Mapping[str, np.ndarray] | None:
        """The centre updates are clipped towards (None: none this round)."""

    def undecided(self, device: str) -> bool:
        """Whether an update of `device` is held without a verdict yet (a cold start, or a fold that
        decides at the close)."""

    def result(self) -> dict[str, np.ndarray]:
        """The round's aggregate step; called once, when the round closes."""

    def report(self) -> FoldReport: ...
