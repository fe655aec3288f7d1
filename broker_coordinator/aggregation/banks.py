"""A round's verdict on its own updates, in a streaming fold: `banks` partial sums instead of one.

The consensus stage (`consensus.py`) judges a round when it closes, after every update is folded:
its flags lower a device's weight from its next update on, so an attacker's first update, and
the first after its flags have aged out, count in full. In bench/attacks.py that is where the 20%
runs lose most (docs/RESEARCH.md, "Where the 20% misses come from"): one unflagged update in a late
round, whose honest updates nearly cancel, moved the model 8 points.

Holding the round's updates to drop the flagged ones would cost O(cohort x model). Instead each
update is folded into one of `banks` sums, chosen by a keyed hash of its device (a key drawn per
round from the operating system, so a device cannot choose its bank-mates); when the round closes,
a bank that holds an update flagged in this round is merged at `MIN_STANDING` of its weight, the
others in full. Memory: `banks` x model in float64. The price is the flagged device's bank-mates,
about cohort / banks honest updates per flag; in a cohort much larger than `banks` every bank
holds a flag and the scales cancel in the mean, so the verdict falls back to acting from the next
update on, as without banks.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Set

import numpy as np

from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import MIN_STANDING


class VerdictBanks:
    def __init__(self, specs: Mapping[str, tuple[int, ...]], banks: int, normalize_steps: bool = False,
                 key: bytes | None = None) -> None:
        if banks < 1:
            raise ValueError(f"banks must be >= 1, got {banks}")
        self.banks = [StreamingMean(specs, normalize_steps=normalize_steps) for _ in range(banks)]
        self.key = key if key is not None else secrets.token_bytes(16)
        self.members: list[set[str]] = [set() for _ in range(banks)]

    def bank_of(self, device: str) -> int:
        digest = hashlib.blake2b(device.encode(), key=self.key, digest_size=8).digest()
        return int.from_bytes(digest, "big") % len(self.banks)

    def add(self, device: str, delta: Mapping[str, np.ndarray], weight: float, steps: int = 1) -> None:
        i = self.bank_of(device)
        self.banks[i].add(delta, weight, steps)
        self.members[i].add(device)

    def settle(self, into: StreamingMean, flagged: Set[str]) -> dict[str, float]:
        """Merge every bank into `into`, a bank holding a device in `flagged` at MIN_STANDING of its
        weight; returns device -> the scale its update got, for the updates merged at less than 1."""
        scaled: dict[str, float] = {}
        for bank, members in zip(self.banks, self.members):
            if bank.count == 0:
                continue
            scale = MIN_STANDING if members & flagged else 1.0
            if scale < 1:
                scaled |= dict.fromkeys(members, scale)
            into.merge({n: a * scale for n, a in bank.sums.items()}, bank.total_weight * scale,
                       bank.weighted_steps * scale, bank.count)
        self.banks, self.members = [], []  # settled once
        return scaled
