"""Buffered asynchronous mode (`[rounds] mode = "buffered"`): FedBuff (Nguyen et al., AISTATS 2022)
on the coordinator's own intake, trust bounds and fold.

No lock-step rounds. A device gets a task whenever it is idle (its retained
status says so and it has no task outstanding); the task names the model
version it trains from. Accepted updates go into a buffer; after K of them
(`buffer_size`) the server rule applies the buffer as the next version, which
is recorded, evaluated and checkpointed like a round (its `round` is the
version's sequence number). An update trained s versions ago is accepted
while s <= S (`max_staleness`) with the factor f(s) of `staleness.py`, and
dropped beyond that with the reason `too_stale` (logged, counted, and sent in
the device's receipt).

The buffer's step, with n_k the trusted sample weight of update k:
    step = sum_k n_k f(s_k) delta_k / sum_k n_k
FedBuff's sum_k f(s_k) delta_k / K with sample weights. It is the robust fold
(`RobustRound`, given the weights n_k f(s_k)) scaled by
sum_k n_k f(s_k) / sum_k n_k, so the norm bound and the direction gate still
see every delta at its own length (`DampedAggregate`).

A task is (round, attempt) = (the version being built when it was sent, a
per-version ticket number): unique across restarts (`Store.start_attempt`),
so receipts, the replay guard and the agent's bookkeeping work unchanged.
Several versions are in flight at once: a release stays retained while a task
that names it is outstanding and within S versions of the newest.

With `[privacy] mode = "central"` each version is one private release (engine/private_rounds.py:
rate 1, the fold over K) and a device gets no second task while it has an update in the buffer.

Algorithms with a server dual (FedDyn's and FedSMOO's H, DynSAM's) are told the buffer's damping
and mean staleness before they step (`ServerRule.pace`): H adds up the undamped mean, as the devices'
duals do, and enters the model damped by the staleness (`edgefl_protocol/algorithms/feddyn.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from broker_coordinator.aggregation.damping import Damped
from broker_coordinator.aggregation.staleness import staleness_factor
from broker_coordinator.engine.coordinator import Coordinator, RoundFailed
from broker_coordinator.engine.intake import Judged, _clock
from broker_coordinator.engine.rounds import Round, RoundState
from broker_coordinator.engine.selection import select
from broker_coordinator.settings.round_settings import RoundRecord, RoundSettings
from broker_coordinator.storage.store import model_sha256
from edgefl_protocol import messages, topics
from edgefl_protocol.errors import Rejected

log = logging.getLogger("broker_coordinator")
POLL = 0.2  # seconds between looks for idle devices when no message arrives


def coordinator_class(settings: RoundSettings) -> type[Coordinator]:
    """The coordinator that runs `settings.mode`."""
    return BufferedCoordinator if settings.mode == "buffered" else Coordinator


@dataclass
class Ticket:
    device: str
    version: int  # the model version the task trains from
    deadline: float


class BufferedCoordinator(Coordinator):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tickets: dict[tuple[int, int], Ticket] = {}  # (round, attempt) of each task not yet answered
        self.working: dict[str, tuple[int, int]] = {}  # device -> its outstanding task
        self.releases: dict[int, int] = {}  # older model versions kept retained (version -> chunks)
        self.buffer: Round | None = None
        self.folded: set[tuple[int, int]] = set()  # tasks whose updates are in the buffer

    # the loop -----------------------------------------------------------------------
    def run_round(self, round_no: int | None = None) -> RoundRecord:
        """Hand out tasks and fold answers until the buffer holds K updates; apply it as the next version."""
        s = self.settings
        round_no = round_no or self.next_round
        if not self._presence_settled:
            self._settle_presence()
        if self.buffer is None or self.buffer.number != round_no:
            if self.privacy:
                self.privacy.check_budget(round_no)  # raises BudgetSpent: no further version is built
            self.buffer = self._open_buffer(round_no)
        buffer = self.buffer
        patience = s.round_timeout * max(s.max_attempts, 1)
        count, progress_at = buffer.aggregate.count, time.monotonic()
        while buffer.aggregate.count < s.buffer_size:
            if self.stopping.is_set():
                raise RoundFailed(f"version {round_no}: coordinator shutting down")
            self._dispatch(buffer)
            self._drain(POLL, buffer)
            self._expire()
            if buffer.aggregate.count > count:
                count, progress_at = buffer.aggregate.count, time.monotonic()
            elif time.monotonic() - progress_at > patience:
                raise RoundFailed(f"version {round_no}: no update accepted for {patience:.0f} s "
                                  f"({count} of {s.buffer_size} in the buffer, {len(self.working)} tasks out, "
                                  f"{len(self.online)} devices online)")
        self.buffer = None
        buffer.cohort = buffer.answered | set(buffer.refused)  # a full buffer is complete; tasks out carry over
        self._set_state(buffer, RoundState.CLOSED, self._summary(buffer))
        record = self._conclude(buffer, model_sha256(self.weights))
        self._retire_releases()
        return record

    def _open_buffer(self, round_no: int) -> Round:
        s = self.settings
        rnd = self._open_round(round_no, 1, set(), time.time() + s.round_timeout, len(self.online))
        rnd.aggregate = Damped(rnd.aggregate, scale_step=True)
        self.folded = set()
        self._set_state(rnd, RoundState.COLLECTING)
        return rnd

    def _summary(self, buffer: Round) -> str:
        stale = [m["staleness"] for m in buffer.device_metrics.values() if "staleness" in m]
        dropped = buffer.rejected.get("too_stale", 0)
        return (f"buffer of {buffer.aggregate.count}: staleness {min(stale, default=0)}-{max(stale, default=0)}, "
                f"damping {buffer.aggregate.report().damping:.3f}" + (f", {dropped} too stale dropped" if dropped else ""))

    def _dispatch(self, buffer: Round) -> None:
        """A task for every idle device without one (at most `clients_per_round` out at a time; 0 = no cap)."""
        s = self.settings
        # with [privacy], a device lands at most once in a buffer (its sensitivity stays C): no second task
        idle = [d for d in self.eligible() if d not in self.working and not (self.privacy and d in buffer.answered)]
        room = (s.clients_per_round - len(self.working)) if s.clients_per_round else len(idle)
        if not idle or room <= 0:
            return
        chosen = select(s.selection, idle, room, self.rng, self.last_metrics)
        deadline = time.time() + s.round_timeout
        self._publish_model(deadline)
        hparams, broadcast = s.task_hparams(buffer.number), self.server_rule.broadcast()
        payloads = []
        for device in chosen:
            attempt = self._next_attempt(buffer.number)
            task = messages.Task(buffer.number, self.version, deadline, s.algorithm, hparams, broadcast, s.codec,
                                 attempt, self.objective.task, self.objective.loss, evaluate=self.evaluate_devices)
            self.tickets[(buffer.number, attempt)] = Ticket(device, self.version, deadline)
            self.working[device] = (buffer.number, attempt)
            buffer.cohort.add(device)
            payloads.append((topics.task(self.fed, device), messages.encode("task", task)))
        assert self.session is not None
        for topic in self.session.publish_all(payloads, min(deadline, time.time() + 60)):
            log.error("version %d: the task for %s could not be published", buffer.number, topic.split("/")[3])

    def _next_attempt(self, round_no: int) -> int:
        """Task numbers never repeat within a version, across restarts too (an answer names its task)."""
        if round_no not in self.attempts and self.store:
            self.attempts[round_no] = self.store.last_attempt(round_no)
        self.attempts[round_no] = self.attempts.get(round_no, 0) + 1
        if self.store:
            self.store.start_attempt(round_no, self.attempts[round_no])
        return self.attempts[round_no]

    def _expire(self) -> None:
        """A device silent past its task's deadline is free for a new task; its ticket is kept a while
        longer, so that a late answer is told it was late."""
        now = time.time()
        for device, key in list(self.working.items()):
            if self.tickets[key].deadline < now:
                log.info("%s did not answer task %d.%d by its deadline; it may get a new one", device, *key)
                del self.working[device]
        for key, ticket in list(self.tickets.items()):
            if ticket.deadline + self.settings.round_timeout < now:
                del self.tickets[key]
        self._retire_releases()

    # model releases -----------------------------------------------------------------
    def _clear_release(self, version: int, chunks: int) -> None:
        # the base class clears the previous release when it publishes a new one: tasks out may need it
        self.releases[version] = chunks
        self._retire_releases()

    def _retire_releases(self) -> None:
        needed = {self.tickets[key].version for key in self.working.values()}
        oldest = self.version - self.settings.max_staleness  # anything older would be dropped anyway
        for version, chunks in list(self.releases.items()):
            if version != self.version and (version not in needed or version < oldest):
                del self.releases[version]
                super()._clear_release(version, chunks)

    # the intake's buffered rules ----------------------------------------------------
    def _check_fresh(self, current: Round | None, device: str, answer: messages.Update | messages.Refusal,
                     arrived: float) -> None:
        """The answer must be to a task this device holds; an update must be trained on the version the
        task named and at most S versions behind. Consumes the ticket: whatever becomes of the answer,
        the task is done and the device may get another."""
        key = (answer.round, answer.attempt)
        ticket = self.tickets.get(key)
        if ticket is None:
            raise Rejected("stale", f"no task {key[0]}.{key[1]} is open: it was answered, expired long ago, or "
                                    "was sent before the coordinator restarted")
        if ticket.device != device:
            raise Rejected("not_selected", f"task {key[0]}.{key[1]} was sent to {ticket.device}, not {device}")
        del self.tickets[key]
        if self.working.get(device) == key:
            del self.working[device]
        if arrived > ticket.deadline:
            raise Rejected("late", f"task {key[0]}.{key[1]} was due at {_clock(ticket.deadline)}, the answer "
                                   f"arrived {_clock(arrived)}")
        if isinstance(answer, messages.Refusal):
            return
        if self.privacy and current is not None and device in current.answered:
            raise Rejected("duplicate", f"{device} already has an update in version {current.number}'s buffer "
                                        "([privacy]: one update per device per version)")
        if answer.model_version != ticket.version:
            raise Rejected("stale", f"update was trained on model version {answer.model_version}, its task named "
                                    f"version {ticket.version}")
        staleness = self.version - ticket.version
        if staleness > self.settings.max_staleness:
            raise Rejected("too_stale", f"update was trained on model version {ticket.version}; the server is at "
                                        f"version {self.version}, {staleness} versions later, and accepts at most "
                                        f"{self.settings.max_staleness} ([rounds] max_staleness)")

    def _factor(self, update: messages.Update) -> float:
        return staleness_factor(self.settings.staleness_weight, self.version - update.model_version)

    def _weight_and_steps(self, device: str, update: messages.Update) -> tuple[float, int, str]:
        weight, steps, note = super()._weight_and_steps(device, update)
        return weight * self._factor(update), steps, note

    def _fold(self, current: Round, device: str, answer: messages.Update | messages.Refusal,
              judged: Judged | messages.Refusal, size: int, digest: str) -> None:
        super()._fold(current, device, answer, judged, size, digest)
        if isinstance(answer, messages.Update) and not isinstance(judged, messages.Refusal):
            factor, staleness = self._factor(answer), self.version - answer.model_version
            current.aggregate.damp(judged[1], factor, staleness)  # type: ignore[attr-defined]
            current.device_metrics[device].update(staleness=staleness, staleness_factor=round(factor, 4))
            self.folded.add((answer.round, answer.attempt))

    def _books_to(self, current: Round | None, answered: tuple[int, int]) -> Round | None:
        return current  # every answer is to a task of some version: it counts against the buffer it met

    def _still_open(self, current: Round | None, round_no: int, attempt: int) -> bool:
        return current is not None and (round_no, attempt) in self.folded
