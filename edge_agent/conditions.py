"""When this device may train: its owner's conditions (`[conditions]` in agent.toml).

The device belongs to someone whose own applications come first. Its owner says when the agent may
take the CPU: hours of the day (local time), a CPU load and a temperature above which it waits,
and a cap on the CPU-seconds it trains per day. `Conditions.check(now)` gives the first condition
not met (a `Reason`), or None when the device may train. The agent says so in its retained status
(`eligible`, and `why` when not), so the coordinator does not select it; it checks again while
idle and republishes only when the answer changes; a task that arrives while it may not train is
refused (signed, with the reason). A training that has started is finished.

- hours: "22:00-06:00", or several: "12:00-13:00, 22:00-06:00"; a range that ends before it starts
  crosses midnight.
- max_load: the 1-minute load average (os.getloadavg) per core, less what the agent's own recent
  training still adds to it (`training_budget.own_load`): the device's other work, not the agent's.
- max_temperature: the hottest /sys/class/thermal/thermal_zone*/temp; a board without a sensor has
  no limit, said once at INFO.
- daily_cpu_seconds: the process CPU time (all threads) spent training since local midnight,
  counted in the state dir (`training_budget`), checked before a task starts.

Everything read from the system (the clock, the load, the temperature, the process CPU time) is
a callable given to `Conditions`, so tests drive them.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from .training_budget import TrainingBudget

if TYPE_CHECKING:
    from .config import ConditionsSettings

log = logging.getLogger("edge_agent")
THERMAL = Path("/sys/class/thermal")
DAY_MINUTES = 24 * 60
_RANGE = re.compile(r"^(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})$")


@dataclass(frozen=True)
class Reason:
    """Why the device may not train now. `condition` (hours | cpu_seconds | temperature | load) says
    which one failed; the agent republishes its status when that changes, not when a reading does."""

    condition: str
    text: str

    def __str__(self) -> str:
        return self.text


class Hours:
    """Ranges of local time of day in which the device may train; empty: any time."""

    def __init__(self, text: str) -> None:
        self.text = ", ".join(part.strip() for part in text.split(",")) if text.strip() else ""
        self.ranges = [self._parse(part.strip()) for part in text.split(",")] if self.text else []

    @staticmethod
    def _parse(part: str) -> tuple[int, int]:
        match = _RANGE.match(part)
        example = 'like "22:00-06:00" (several: "12:00-13:00, 22:00-06:00"; "" = any time)'
        if not match:
            raise ValueError(f"hours must be ranges of local time {example}, got {part!r}")
        h1, m1, h2, m2 = (int(g) for g in match.groups())
        start, end = h1 * 60 + m1, h2 * 60 + m2
        if h1 > 23 or m1 > 59 or m2 > 59 or end > DAY_MINUTES:
            raise ValueError(f"hours: {part!r} is not a time range {example}")
        if start == end % DAY_MINUTES:
            raise ValueError(f"hours: {part!r} is empty or the whole day; for any time leave hours empty")
        return start, end

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __contains__(self, moment: datetime) -> bool:
        minute = moment.hour * 60 + moment.minute
        return any(start <= minute < end if start < end else minute >= start or minute < end
                   for start, end in self.ranges)

    def __str__(self) -> str:
        return self.text


def read_load() -> float | None:
    """The 1-minute load average of the whole machine, or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def read_temperature(root: Path = THERMAL) -> float | None:
    """The hottest thermal zone in degrees Celsius (the kernel gives millidegrees), or None without one."""
    readings = []
    for path in sorted(root.glob("thermal_zone*/temp")):
        try:
            celsius = int(path.read_text().strip()) / 1000
        except (OSError, ValueError):
            continue  # a zone whose driver cannot read its sensor now
        if -40.0 < celsius < 200.0:  # some drivers report a placeholder for a disabled sensor
            readings.append(celsius)
    return max(readings) if readings else None


class Conditions:
    """The owner's conditions on this device, checked against the clock, the load and the temperature."""

    def __init__(self, settings: ConditionsSettings, state_dir: Path | str, *,
                 clock: Callable[[], datetime] = datetime.now,
                 load: Callable[[], float | None] = read_load,
                 temperature: Callable[[], float | None] | None = None,
                 cpu_time: Callable[[], float] = time.process_time,
                 cores: int | None = None, thermal: Path = THERMAL) -> None:
        self.settings = settings
        self.hours = Hours(settings.hours)
        self.budget = TrainingBudget(state_dir)
        self.clock, self.load, self.cpu_time = clock, load, cpu_time
        self.temperature = temperature or (lambda: read_temperature(thermal))
        self.cores = cores or os.cpu_count() or 1
        self.thermal = thermal
        self._said: set[str] = set()  # readings this system lacks, each said once

    @property
    def enabled(self) -> bool:
        s = self.settings
        return bool(self.hours or s.max_load or s.max_temperature or s.daily_cpu_seconds)

    def check(self, now: datetime | None = None) -> Reason | None:
        """The first condition not met at `now` (local time; default: the clock), or None."""
        now = now or self.clock()
        s = self.settings
        if self.hours and now not in self.hours:
            return Reason("hours", f"outside training hours ({self.hours})")
        spent = self.budget.spent(now.date())
        if s.daily_cpu_seconds and spent >= s.daily_cpu_seconds:
            return Reason("cpu_seconds", f"trained {spent:.0f} CPU-seconds today, the daily cap is "
                                         f"{s.daily_cpu_seconds:g} (daily_cpu_seconds; it resets at midnight)")
        if s.max_temperature:
            celsius = self.temperature()
            if celsius is None:
                self._say_once("temperature", f"no temperature sensor under {self.thermal}: max_temperature "
                                              "is not enforced on this device")
            elif celsius > s.max_temperature:
                return Reason("temperature", f"temperature {celsius:.1f} °C, above max_temperature "
                                             f"{s.max_temperature:g} °C")
        if s.max_load:
            load = self.others_load(now)
            if load is None:
                self._say_once("load", "this system reports no load average: max_load is not enforced")
            elif load > s.max_load:
                return Reason("load", f"CPU load {load:.2f} per core besides its own training, above "
                                      f"max_load {s.max_load:g}")
        return None

    def others_load(self, now: datetime) -> float | None:
        """The 1-minute load average per core, less what the agent's own recent training adds to it."""
        raw = self.load()
        if raw is None:
            return None
        return max(0.0, raw - self.budget.own_load(now.timestamp())) / self.cores

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around one training: its CPU-seconds go to today's count, its span to the load estimate
        (also when it is stopped midway: the CPU was spent)."""
        started, cpu = self.clock(), self.cpu_time()
        try:
            yield
        finally:
            self.budget.add(started, self.clock(), max(0.0, self.cpu_time() - cpu))

    def describe(self, now: datetime | None = None) -> str:
        """The conditions in one line, with today's CPU-seconds against the cap."""
        now = now or self.clock()
        s, parts = self.settings, []
        if self.hours:
            parts.append(f"hours {self.hours}")
        if s.max_load:
            parts.append(f"load at most {s.max_load:g} per core")
        if s.max_temperature:
            parts.append(f"temperature at most {s.max_temperature:g} °C")
        if s.daily_cpu_seconds:
            parts.append(f"{s.daily_cpu_seconds:g} CPU-seconds a day ({self.budget.spent(now.date()):.0f} "
                         "used today)")
        return ", ".join(parts) if parts else "none (it may train whenever the coordinator asks)"

    def _say_once(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.info("%s", text)
