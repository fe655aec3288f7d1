"""What the agent's training has cost this device: CPU-seconds per local day, and recent trainings.

The owner's `[conditions] daily_cpu_seconds` caps the first; the second lets the load check leave
the agent's own training out of the load average (`own_load`). Both live in
`<state_dir>/training_budget.json`, written atomically after every training, so a restart does not
reset the day's count; the count starts again at local midnight.

The kernel's 1-minute load average is an exponential average of the runnable threads with a
time constant of 60 s. A training that ran r threads' worth of CPU (its CPU-seconds over its wall
seconds) from s to e still adds r (1 - e^-(e-s)/60) e^-(t-e)/60 to it at a later time t.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import date, datetime
from pathlib import Path

from edgefl_protocol.persist import atomic_write

log = logging.getLogger("edge_agent")
BUDGET_FILE = "training_budget.json"
LOAD_TAU = 60.0  # seconds: the time constant of the kernel's 1-minute load average
FORGET_AFTER = 600.0  # seconds: a training that ended this long ago adds under 0.01% of its rate


class TrainingBudget:
    """CPU-seconds spent training on one local day, and the trainings of the last few minutes."""

    def __init__(self, state_dir: Path | str) -> None:
        self.path = Path(state_dir) / BUDGET_FILE
        self.day = ""  # ISO date of the day `cpu_seconds` counts
        self.cpu_seconds = 0.0
        self.spans: list[tuple[float, float, float]] = []  # (start, end, CPU-seconds), unix seconds
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
            self.day, self.cpu_seconds = str(raw["day"]), float(raw["cpu_seconds"])
            self.spans = [(float(s), float(e), float(c)) for s, e, c in raw.get("spans", [])]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s is unreadable (%s): today's training CPU-seconds count from 0", self.path, exc)
            self.day, self.cpu_seconds, self.spans = "", 0.0, []

    def spent(self, today: date) -> float:
        """CPU-seconds trained on `today` (0 on a day not yet trained)."""
        return self.cpu_seconds if self.day == today.isoformat() else 0.0

    def add(self, start: datetime, end: datetime, cpu_seconds: float) -> None:
        """One training, counted to the day it ended on, and saved."""
        day = end.date().isoformat()
        if day != self.day:
            self.day, self.cpu_seconds = day, 0.0
        self.cpu_seconds += cpu_seconds
        finished = end.timestamp()
        self.spans = [s for s in self.spans if finished - s[1] < FORGET_AFTER]
        self.spans.append((start.timestamp(), finished, cpu_seconds))
        self.save()

    def save(self) -> None:
        text = json.dumps({"day": self.day, "cpu_seconds": round(self.cpu_seconds, 3),
                           "spans": [[round(v, 3) for v in span] for span in self.spans]})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, text)
        except OSError as exc:  # training goes on; only a restart today would forget what it cost
            log.warning("cannot write %s (%s): a restart today would count training CPU-seconds from 0",
                        self.path, exc)

    def own_load(self, at: float) -> float:
        """What the recorded trainings still add to the 1-minute load average at unix time `at`."""
        total = 0.0
        for start, end, cpu in self.spans:
            if at < end:
                continue
            wall = end - start
            # rate x (1 - e^-wall/tau), written so that a training of ~0 s adds its CPU-seconds / tau
            risen = cpu / wall * -math.expm1(-wall / LOAD_TAU) if wall > 1e-6 else cpu / LOAD_TAU
            total += risen * math.exp(-(at - end) / LOAD_TAU)
        return total
