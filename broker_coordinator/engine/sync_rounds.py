"""Sync rounds (`[schedule] mode = "sync"`): a cohort, one deadline, and a quorum.

Each attempt of a round chooses a cohort from the units the topology offers (devices, or the
sites' devices), publishes the model and the tasks, and collects answers until every unit has
answered, the deadline, or shutdown. With a quorum (`min_updates`) the round closes and the
engine concludes it; without one the attempt is abandoned (the model is unchanged, every update
it accepted is told it was left out) and the round is tried again with a new cohort, up to
`max_attempts`.

An answer is fresh when it names the open round and attempt, arrives by the deadline, comes from
the cohort, and was trained on the version the round distributed (`RoundFreshness`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from broker_coordinator.engine.records import record_row
from broker_coordinator.engine.rounds import Round, RoundFailed, RoundState
from broker_coordinator.settings.round_settings import RoundRecord
from broker_coordinator.storage.store import model_sha256
from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import Partial

if TYPE_CHECKING:
    from broker_coordinator.engine.loop import Engine

log = logging.getLogger("broker_coordinator")


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


class RoundFreshness:
    """Sync rounds' rules for which answers are still wanted (`intake.Freshness`)."""

    def __init__(self, closed_at: Mapping[int, float]) -> None:
        self.closed_at = closed_at  # round -> when it closed

    def check(self, current: Round | None, device: str, answer: messages.Answer, arrived: float) -> None:
        if answer.round in self.closed_at and (current is None or answer.round != current.number):
            raise Rejected("late", f"round {answer.round} closed at {clock(self.closed_at[answer.round])}, "
                                   f"update arrived {clock(arrived)}")
        if current is None or answer.round != current.number:
            open_round = f"round {current.number} is open" if current else "no round is open"
            raise Rejected("stale", f"update is for round {answer.round}; {open_round}")
        if answer.attempt != current.attempt:
            raise Rejected("stale", f"update is for attempt {answer.attempt} of round {answer.round}; "
                                    f"attempt {current.attempt} is open")
        if arrived > current.deadline:
            raise Rejected("late", f"round {current.number} closed at {clock(current.deadline)}, "
                                   f"update arrived {clock(arrived)}")
        if device not in current.cohort:
            raise Rejected("not_selected", f"{device} was not selected for round {current.number}")
        if device in current.answered or device in current.refused:
            raise Rejected("duplicate", f"{device} already answered round {current.number}")
        if not isinstance(answer, messages.Refusal) and answer.model_version != current.base_version:
            raise Rejected("stale", f"update was trained on model version {answer.model_version}, "
                                    f"round {current.number} distributed version {current.base_version}")

    def books_to(self, current: Round | None, answered: tuple[int, int]) -> Round | None:
        """The open round a rejected answer to `answered` counts against: the one it answered, if open."""
        return current if current is not None and (current.number, current.attempt) == answered else None

    def still_open(self, current: Round | None, round_no: int, attempt: int) -> bool:
        """Whether an accepted answer to (round, attempt) is still in the open aggregate (a resend of it
        is answered again, not rejected as a replay)."""
        return current is not None and (current.number, current.attempt) == (round_no, attempt)

    def factor(self, update: messages.Update) -> float:
        return 1.0

    def folded(self, current: Round, device: str, update: messages.Update, weight: float) -> None:
        """Nothing beyond the fold."""


class SyncRounds:
    def __init__(self, closed_at: Mapping[int, float]) -> None:
        self.freshness = RoundFreshness(closed_at)
        self.keeps_older_releases = False

    def run_round(self, engine: Engine, round_no: int) -> RoundRecord:
        """Run the round to its end, retrying with a new cohort while there is no quorum."""
        base_sha = model_sha256(engine.weights)
        store = engine.store
        # attempt numbers never repeat for a round, across restarts too: an answer names its attempt
        attempt = max(engine.attempts.get(round_no, 0), store.last_attempt(round_no) if store else 0)
        if engine.privacy:
            engine.privacy.check_budget(round_no)  # raises BudgetSpent: the round is not opened
        while True:
            attempt += 1
            engine.attempts[round_no] = attempt
            if store:
                store.start_attempt(round_no, attempt)
            rnd = self.attempt(engine, round_no, attempt)
            if rnd.state == RoundState.CLOSED:
                break
            engine.metrics.rounds.labels("abandoned").inc()
            log.log(logging.INFO if engine.stopping.is_set() else logging.WARNING,
                    "round %d attempt %d abandoned: %s; the global model is unchanged", round_no, attempt, rnd.reason)
            engine.intake.abandoned(rnd)
            if store:
                store.record_round(record_row(engine.record(rnd, base_sha, base_sha, "abandoned")))
            if engine.stopping.is_set():
                raise RoundFailed(f"round {round_no} abandoned: {rnd.reason}")
            if engine.settings.max_attempts and attempt >= engine.settings.max_attempts:
                raise RoundFailed(f"round {round_no} found no quorum in {attempt} attempts: {rnd.reason}")
        return engine.conclude(rnd, base_sha)

    def attempt(self, engine: Engine, round_no: int, attempt: int) -> Round:
        s, topology = engine.settings, engine.topology
        engine.settle_presence()
        # wait (up to round_timeout) until a quorum of devices is eligible; the round's own deadline starts
        # when it opens: opened on what was left of the wait, a fresh federation whose devices came online
        # late in it gave them seconds to train, and its first release seconds to be published
        waited = time.time() + s.round_timeout
        while (topology.presence.eligible_devices() < s.min_updates and time.time() < waited
               and not engine.stopping.is_set()):
            engine.drain(min(0.5, waited - time.time()))
        deadline = time.time() + s.round_timeout
        rnd, offered = topology.open(engine, round_no, attempt, deadline)
        rnd.train = not s.evaluation_only(round_no)
        if engine.on_state:
            engine.on_state(rnd)
        if offered < s.min_updates:
            engine.set_state(rnd, RoundState.ABANDONED, topology.too_few(offered, s.min_updates))
            return rnd
        engine.publish_model(deadline)
        task = engine.task(round_no, attempt, topology.task_deadline(deadline, s.round_timeout),
                           evaluate=engine.evaluate_devices or not rnd.train, train=rnd.train)
        unsent = topology.send_tasks(engine, rnd, task, deadline)
        self.collect(engine, rnd, deadline)
        count = topology.counted(rnd)
        if engine.stopping.is_set():
            engine.set_state(rnd, RoundState.ABANDONED, "coordinator shutting down")
        elif count >= s.min_updates:
            engine.set_state(rnd, RoundState.CLOSED, topology.closed_because(rnd))
        else:
            why = topology.short_because(rnd, count, s.min_updates)
            if rnd.refused:
                reasons = Counter(rnd.refused.values()).most_common(2)
                why += f"; {len(rnd.refused)} refused the task ({'; '.join(r for r, _ in reasons)})"
            if unsent:
                why += f"; {len(unsent)} tasks could not be published"
            engine.set_state(rnd, RoundState.ABANDONED, why)
        return rnd

    def collect(self, engine: Engine, rnd: Round, deadline: float) -> None:
        """Take answers as they arrive until every expected one is in, the deadline, or shutdown."""
        engine.set_state(rnd, RoundState.COLLECTING)
        while not rnd.complete and time.time() < deadline and not engine.stopping.is_set():
            engine.drain(min(0.5, deadline - time.time()), rnd)

    def check_partial(self, engine: Engine, current: Round | None, site: str, partial: Partial) -> int | None:
        """A partial must answer the open round's attempt, once per expected worker, for the version
        the round distributed. None: no staleness (a sync round)."""
        if current is None or (partial.round, partial.attempt) != (current.number, current.attempt):
            open_round = f"round {current.number} (attempt {current.attempt}) is open" if current else "none is open"
            raise Rejected("stale", f"partial is for round {partial.round} (attempt {partial.attempt}); {open_round}")
        sender = f"{site}/{partial.worker}"
        if sender not in current.cohort:
            raise Rejected("not_selected", f"worker {partial.worker} of site {site} was not expected "
                                           f"({engine.topology.sites[site].workers} workers configured)")
        if sender in current.answered:
            raise Rejected("duplicate", f"worker {partial.worker} of site {site} already sent its partial")
        if partial.model_version != current.base_version:
            raise Rejected("stale", f"partial folds updates to version {partial.model_version}, the round "
                                    f"distributed version {current.base_version}")
        return None

    def leave(self, current: Round, unit: str) -> None:
        """`unit` will not answer (revoked): the round no longer waits for it."""
        current.cohort.discard(unit)

    def retire_releases(self, engine: Engine) -> None:
        """Sync rounds clear the previous release when they publish the next."""
