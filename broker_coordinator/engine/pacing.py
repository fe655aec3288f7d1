"""Pacing: when the service opens the next round, and when the federation rests.

Rounds start `interval` apart (a round that takes longer starts the next at once). After each
evaluated round the served model's score is compared with its best: when it has not improved by
`min_improvement` in `patience` evaluations the federation rests, holding no device's CPU, until
its devices hold `new_data` more samples than when it stopped (they report their sample counts in
their presence) or the operator runs `broker-coordinator resume`. While it waits the engine keeps
reading its inbox, so presence stays current and a late answer still gets its receipt.

What the pacer decided is kept in `pacing.json` in the state directory, so that `status` can say
why the federation is idle and what wakes it, and a restarted coordinator keeps resting.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from broker_coordinator.settings.pacing_settings import PacingSettings
from broker_coordinator.settings.round_settings import RoundRecord
from edgefl_protocol.persist import atomic_write

if TYPE_CHECKING:
    from broker_coordinator.engine.loop import Engine
    from broker_coordinator.reporting.metrics import Metrics

log = logging.getLogger("broker_coordinator")
STATE_FILE = "pacing.json"
RESUME_FILE = "resume.request"  # written by `broker-coordinator resume`


@dataclass
class PaceState:
    state: str = "running"  # running | waiting (for the interval) | resting (converged)
    why: str = ""
    wakes: str = ""
    best: float | None = None  # the served model's best score so far
    best_round: int = 0
    unimproved: int = 0  # evaluations since the best
    samples_at_rest: int = 0  # the devices' samples when the federation began to rest
    last_start: float = 0.0  # unix time the last round opened
    since: float = 0.0  # unix time of the last change of state


def read_pace(state_dir: Path | str) -> PaceState | None:
    """What the running (or last) coordinator's pacer decided; None before its first round."""
    try:
        raw = json.loads((Path(state_dir) / STATE_FILE).read_text())
        return PaceState(**{k: v for k, v in raw.items() if k in PaceState.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


def request_resume(state_dir: Path | str) -> Path:
    """Ask a resting federation to resume (the running coordinator picks it up within a second)."""
    path = Path(state_dir) / RESUME_FILE
    path.write_text(f"{time.time()}\n")
    return path


class Pacer:
    def __init__(self, settings: PacingSettings, state_dir: Path | str | None, higher_is_better: bool = True,
                 clock: Callable[[], float] = time.time, metrics: Metrics | None = None) -> None:
        self.settings, self.higher_is_better, self.clock, self.metrics = settings, higher_is_better, clock, metrics
        if metrics is not None:
            metrics.pacing_interval.set(settings.interval_seconds)
        self.dir = Path(state_dir) if state_dir is not None else None
        self.pace = (read_pace(self.dir) if self.dir else None) or PaceState(since=clock())
        if self.pace.state == "waiting":
            self.pace.state = "running"  # a restart does not wait for a round that never ran
        if self.pace.state == "resting":
            log.info("the federation is resting (%s); %s", self.pace.why, self.pace.wakes)
        self._gauge()

    # after each round: the stop rule ----------------------------------------------------
    def observe(self, record: RoundRecord, samples: int) -> None:
        score = record.score if math.isfinite(record.score) else (record.federated or {}).get("score")
        if not isinstance(score, (int, float)) or not math.isfinite(score):
            return  # nothing measured: the rule waits for an evaluation
        pace, margin = self.pace, self.settings.min_improvement
        better = (pace.best is None or (score > pace.best + margin if self.higher_is_better
                                        else score < pace.best - margin))
        if better:
            pace.best, pace.best_round, pace.unimproved = float(score), record.round, 0
        else:
            pace.unimproved += 1
        patience = self.settings.patience
        if patience and pace.unimproved >= patience:
            pace.samples_at_rest = samples
            self._move("resting", f"the served model has not improved by {margin:g} in {patience} evaluations "
                                  f"(best {pace.best:.4g} at round {pace.best_round})", self._wakes(samples))
            log.info("round %d: the federation rests: %s; %s", record.round, pace.why, pace.wakes)
        self._save()

    def _wakes(self, samples: int) -> str:
        resume = "on `broker-coordinator resume`"
        if not self.settings.new_data:
            return f"it resumes {resume}"
        need = math.ceil(samples * (1 + self.settings.new_data))
        return (f"it resumes when the devices hold {need} samples ({samples} now, {self.settings.new_data:.0%} "
                f"more) or {resume}")

    # before each round ------------------------------------------------------------------
    def wait(self, engine: Engine) -> None:
        """Until the next round may open: its interval has passed, and the federation is not resting."""
        interval = self.settings.interval_seconds
        while not engine.stopping.is_set():
            if self.pace.state == "resting":
                woken = self._woken(engine)
                if woken is None:
                    engine.idle(1.0)
                    continue
                log.info("the federation resumes: %s", woken)
                self.pace.best, self.pace.unimproved = None, 0  # new data: the old best is no yardstick
            due = self.pace.last_start + interval
            if self.clock() >= due:
                break
            if self.pace.state != "waiting":
                self._move("waiting", f"rounds start {self.settings.interval} apart",
                           f"the next round opens at {time.strftime('%H:%M:%S', time.localtime(due))}")
                self._save()
            engine.idle(min(1.0, due - self.clock()))
        if engine.stopping.is_set():
            return  # shutting down: what it was waiting for still holds for the next start
        self.pace.last_start = self.clock()
        self._move("running", "", "")
        self._save()

    def _woken(self, engine: Engine) -> str | None:
        if self.dir is not None and (request := self.dir / RESUME_FILE).exists():
            request.unlink(missing_ok=True)
            return "the operator asked (`broker-coordinator resume`)"
        if self.settings.new_data:
            samples = engine.presence_samples()
            if samples >= math.ceil(self.pace.samples_at_rest * (1 + self.settings.new_data)) and samples > 0:
                return f"the devices hold {samples} samples, {self.pace.samples_at_rest} when it began to rest"
        return None

    def _move(self, state: str, why: str, wakes: str) -> None:
        if state != self.pace.state:
            self.pace.since = self.clock()
        self.pace.state, self.pace.why, self.pace.wakes = state, why, wakes
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.resting.set(self.pace.state == "resting")

    def _save(self) -> None:
        if self.dir is None:
            return
        # status never reads half a file; readable by the operator's status command (0644)
        atomic_write(self.dir / STATE_FILE, json.dumps(asdict(self.pace), indent=1), mode=0o644)
