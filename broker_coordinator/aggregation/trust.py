"""What the server believes of a device's update: its aggregation weight and its size.

A signed update is still only a claim. Two things in it can move the global
model further than the device's share of the work: the sample count it
reports (its aggregation weight) and the length of its delta. Both are bounded
here from what the coordinator itself has seen, never from one device's word.

Sample weights (`RoundSettings.weighting`):
- `capped` (default): the reported count, clipped (a) to `growth` times the
  count this device had accepted last time, and (b) to `cap_factor` times the
  median of the trusted counts of the other known devices. While fewer than
  `MIN_KNOWN` devices are known (a fresh federation) every weight of the
  round is 1: no one's claim can dominate a cold start.
- `uniform`: every accepted update weighs 1.
- `reported`: the device's own count (FedAvg as published; trusts devices).

Update size (`RoundSettings.norm_bound`): each delta is scaled down to at most
`norm_bound` times the median L2 norm of the latest accepted deltas, one per
device of the last `window` heard from. What a device's entry records is its
norm, but at most the larger of the bound it was judged by and `GROWTH` times
its own previous entry (and never less than `FLOOR`): the updates being
bounded cannot pull the bound up faster than that, and no history (a run of
zero or tiny deltas included) can hold it down, because honest entries grow
back by `GROWTH` per record. Until `warmup` norms are known the round holds
its updates and clips them with the bound of what it has seen (see `robust`).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from broker_coordinator.settings.choices import WEIGHTINGS

MIN_KNOWN = 3  # devices with a trusted count before counts are used as weights
GROWTH = 2.0  # a device's recorded norm may exceed the bound it was judged by only up to this times its last
MIN_STANDING = 0.05  # centered_clip: the least share of its weight a device keeps, however often it is clipped
RADIUS_WARMUP = 3  # devices' distances before the radius holds: a round of 3 or 4 is defended from the start
STRIKES = 2  # a device loses standing from its second strike among its last STRIKE_WINDOW judged updates
STRIKE_WINDOW = 5  # (an honest device's data can put one update outside; an attacker's keep doing it)
FLOOR = 1e-3  # L2 norm: no bound goes below multiplier x FLOOR, and a record starts at least from it


@dataclass
class Weighed:
    weight: float  # the sample count the server uses
    note: str = ""  # why it differs from the report, for the log; "" when it does not


class SampleWeights:
    def __init__(self, mode: str = "capped", cap_factor: float = 2.0, growth: float = 2.0) -> None:
        if mode not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {mode!r}")
        self.mode, self.cap_factor, self.growth = mode, cap_factor, growth
        self.known: dict[str, float] = {}  # device -> trusted sample count
        self.round_cap: float | None = None  # fixed per round, so all weights of a round share one scale

    def start_round(self) -> None:
        self.round_cap = (self.cap_factor * statistics.median(self.known.values())
                          if len(self.known) >= MIN_KNOWN else None)

    def weigh(self, device: str, reported: int) -> Weighed:
        if self.mode == "reported":
            return Weighed(float(reported))
        if self.mode == "uniform":
            return Weighed(1.0)
        trusted, notes = float(reported), []
        last = self.known.get(device)
        if last is not None and trusted > self.growth * last:
            trusted = self.growth * last
            notes.append(f"jumped from {last:.0f} to {reported}")
        if self.round_cap is not None and trusted > self.round_cap:
            trusted = self.round_cap
            notes.append(f"above {self.cap_factor:g}x the federation's median")
        # remember what we trust, not what was claimed (a cold start remembers the claim: the
        # median of many devices is what bounds it later)
        self.known[device] = trusted if self.round_cap is not None or last is not None else float(reported)
        if self.round_cap is None:
            return Weighed(1.0)  # a cold start: equal weights for the round, nothing clipped
        note = f"sample count {reported} clipped to {trusted:.0f} ({'; '.join(notes)})" if notes else ""
        return Weighed(trusted, note)

    def state(self) -> dict[str, Any]:
        return {"known": dict(self.known)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.known = {str(k): float(v) for k, v in (state.get("known") or {}).items()}


class NormBound:
    """An adaptive bound on the L2 norm of accepted deltas: `multiplier` x the median of recent ones.

    The history keeps one norm per device (its latest, bounded: see `observe`), for the last
    `window` devices heard from: a device that keeps sending zeros (or tiny deltas) holds one entry,
    so it cannot pull the median, and with it every honest device's bound, down to nothing. Should
    a majority ever do so (or a checkpoint hold such a history), the bound stays at least
    `multiplier x FLOOR`, and each honest update raises its device's entry by up to `GROWTH`x, so
    the bound climbs back within a few rounds."""

    def __init__(self, multiplier: float = 1.5, window: int = 100, warmup: int = 5) -> None:
        self.multiplier, self.warmup, self.window = multiplier, warmup, window
        self.by_device: OrderedDict[str, float] = OrderedDict()
        # centered_clip's radius: device -> the share of its weight it keeps, lowered each time the radius
        # clips it again (by radius / distance; see STRIKES) and raised again (x GROWTH, up to 1) by each
        # update inside it
        self.standing: dict[str, float] = {}
        self.strikes: dict[str, list[int]] = {}  # device -> 1 (outside the radius) or 0, its last judged updates
        self._anonymous = 0

    @classmethod
    def radius(cls, multiplier: float) -> NormBound:
        """centered_clip's radius: `multiplier` x the median distance of devices' updates from their
        rounds' centres, from RADIUS_WARMUP devices on (carried over rounds, like the norm bound's)."""
        return cls(multiplier or 1.5, warmup=RADIUS_WARMUP)

    @property
    def enabled(self) -> bool:
        return self.multiplier > 0

    @property
    def history(self) -> list[float]:
        return list(self.by_device.values())

    def bound(self, extra: list[float] | None = None) -> float | None:
        """The bound now; `extra` are norms of held updates, used while the history is short."""
        norms = self.history + list(extra or [])
        if not self.enabled or not norms or (len(norms) < self.warmup and extra is None):
            return None
        return self.multiplier * max(statistics.median(norms), FLOOR)

    def observe(self, norm: float, device: str, bound: float | None) -> float:
        """Record an accepted delta's `norm`, judged by `bound` (None: none yet); returns what was
        recorded: min(norm, max(bound, GROWTH x the device's last entry, FLOOR))."""
        if bound is not None:
            last = self.by_device.get(device, 0.0) if device else 0.0
            norm = min(norm, max(bound, GROWTH * last, FLOOR))
        self.record(norm, device)
        return norm

    def record(self, norm: float, device: str = "") -> None:
        if not device:  # no identity (tests, old checkpoints): each norm its own entry
            self._anonymous += 1
            device = f"#{self._anonymous}"
        self.by_device.pop(device, None)
        self.by_device[device] = float(norm)
        while len(self.by_device) > self.window:
            gone, _ = self.by_device.popitem(last=False)
            self.standing.pop(gone, None)
            self.strikes.pop(gone, None)

    def stand(self, device: str, fraction: float) -> None:
        """A device judged at `fraction` (radius / distance; 1 inside the radius) of what it claimed.
        One update outside costs its device nothing later (that update is clipped already); from the
        second among its last STRIKE_WINDOW each costs its fraction."""
        strikes = self.strikes.setdefault(device, [])
        strikes.append(int(fraction < 1))
        del strikes[:-STRIKE_WINDOW]
        if not any(strikes):
            del self.strikes[device]
        standing = self.standing.get(device, 1.0)
        if fraction >= 1:
            standing = min(1.0, standing * GROWTH)
        elif sum(strikes) >= STRIKES:
            standing *= fraction
        if standing < 1:
            self.standing[device] = max(standing, MIN_STANDING)
        else:
            self.standing.pop(device, None)

    def state(self) -> dict[str, Any]:
        return {"by_device": dict(self.by_device), "standing": dict(self.standing),
                "strikes": {d: list(s) for d, s in self.strikes.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.by_device.clear()
        self._anonymous = 0
        for device, norm in (state.get("by_device") or {}).items():
            self.record(float(norm), str(device))
        for norm in state.get("history") or []:  # a checkpoint from before per-device entries
            self.record(float(norm))
        self.standing = {str(d): float(v) for d, v in (state.get("standing") or {}).items()}
        self.strikes = {str(d): [int(bool(x)) for x in s][-STRIKE_WINDOW:] for d, s in (state.get("strikes") or {}).items()}
