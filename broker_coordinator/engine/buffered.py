"""Buffered asynchronous mode (`[schedule] mode = "buffered"`): FedBuff (Nguyen et al., AISTATS 2022)
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
see every delta at its own length (`aggregation/damping.py`).

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

In a federation in sites the unit of work is a site task instead of a device task (`tree.Sites`):
a site that is online with eligible devices and holds no site task gets one; each partial of an
open ticket is folded with the staleness factor of the version its task named, and the ticket is
done when every worker of the site has sent its partial (or at its deadline):
    step = sum_sites f(s_j) S_j / sum_sites W_j
with S_j, W_j a partial's weighted sum and weight. A worker cannot tell a buffered centre from a
sync one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker_coordinator.aggregation.staleness import staleness_factor
from broker_coordinator.engine.rounds import Round, RoundFailed, RoundState
from broker_coordinator.engine.sync_rounds import clock
from broker_coordinator.settings.round_settings import RoundRecord
from broker_coordinator.storage.store import model_sha256
from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import Partial

if TYPE_CHECKING:
    from broker_coordinator.engine.loop import Engine

log = logging.getLogger("broker_coordinator")
POLL = 0.2  # seconds between looks for idle devices when no message arrives


@dataclass
class Ticket:
    unit: str  # the device or site the task went to
    version: int  # the model version the task trains from
    deadline: float


class BufferedVersions:
    def __init__(self, staleness_weight: str, max_staleness: int, round_timeout: float,
                 version: Callable[[], int], private: bool = False) -> None:
        self.staleness_weight, self.max_staleness = staleness_weight, max_staleness
        self.round_timeout = round_timeout
        self.version = version  # the engine's current model version
        self.tickets: dict[tuple[int, int], Ticket] = {}  # (round, attempt) of each task not yet answered
        self.working: dict[str, tuple[int, int]] = {}  # unit -> its outstanding task
        self.answered_by: dict[tuple[int, int], set[int]] = {}  # a site's ticket -> workers whose partial came
        self.buffer: Round | None = None
        self.in_buffer: set[tuple[int, int]] = set()  # tasks whose updates are in the buffer
        self.keeps_older_releases = True
        self.freshness = self
        self.private = private  # [privacy]: one update per device per version

    # the loop -----------------------------------------------------------------------
    def run_round(self, engine: Engine, round_no: int) -> RoundRecord:
        """Hand out tasks and fold answers until the buffer holds K updates; apply it as the next version."""
        s = engine.settings
        engine.settle_presence()
        if self.buffer is None or self.buffer.number != round_no:
            if engine.privacy:
                engine.privacy.check_budget(round_no)  # raises BudgetSpent: no further version is built
            self.buffer = self.open_buffer(engine, round_no)
        buffer = self.buffer
        patience = s.round_timeout * max(s.max_attempts, 1)
        count, progress_at = buffer.aggregate.count, time.monotonic()
        while buffer.aggregate.count < s.buffer_size:
            if engine.stopping.is_set():
                raise RoundFailed(f"version {round_no}: coordinator shutting down")
            engine.topology.dispatch(engine, self, buffer)
            engine.drain(POLL, buffer)
            self.expire(engine)
            if buffer.aggregate.count > count:
                count, progress_at = buffer.aggregate.count, time.monotonic()
            elif time.monotonic() - progress_at > patience:
                raise RoundFailed(f"version {round_no}: no update accepted for {patience:.0f} s "
                                  f"({count} of {s.buffer_size} in the buffer, {len(self.working)} tasks out, "
                                  f"{engine.topology.presence.population()} devices online)")
        self.buffer = None
        buffer.cohort = buffer.answered | set(buffer.refused)  # a full buffer is complete; tasks out carry over
        engine.set_state(buffer, RoundState.CLOSED, self.summary(buffer))
        record = engine.conclude(buffer, model_sha256(engine.weights))
        self.retire_releases(engine)
        return record

    def open_buffer(self, engine: Engine, round_no: int) -> Round:
        s = engine.settings
        rnd = engine.open_round(round_no, 1, set(), time.time() + s.round_timeout,
                                engine.topology.presence.population(),
                                lambda: engine.topology.buffer_fold(engine, round_no))
        self.in_buffer = set()
        engine.set_state(rnd, RoundState.COLLECTING)
        return rnd

    def summary(self, buffer: Round) -> str:
        stale = [m["staleness"] for m in buffer.device_metrics.values() if "staleness" in m]
        dropped = buffer.rejected.get("too_stale", 0)
        return (f"buffer of {buffer.aggregate.count}: staleness {min(stale, default=0)}-{max(stale, default=0)}, "
                f"damping {buffer.aggregate.report().damping:.3f}" + (f", {dropped} too stale dropped" if dropped else ""))

    def ticket(self, engine: Engine, unit: str, buffer: Round, deadline: float) -> int:
        """A task for `unit` in the version being built: its attempt number (never reused within the
        version, across restarts too: an answer names its task)."""
        round_no = buffer.number
        if round_no not in engine.attempts and engine.store:
            engine.attempts[round_no] = engine.store.last_attempt(round_no)
        engine.attempts[round_no] = attempt = engine.attempts.get(round_no, 0) + 1
        if engine.store:
            engine.store.start_attempt(round_no, attempt)
        self.tickets[(round_no, attempt)] = Ticket(unit, engine.version, deadline)
        self.working[unit] = (round_no, attempt)
        buffer.cohort.add(unit)
        return attempt

    def expire(self, engine: Engine) -> None:
        """A unit silent past its task's deadline is free for a new task; its ticket is kept a while
        longer, so that a late answer is told it was late."""
        now = time.time()
        for unit, key in list(self.working.items()):
            if self.tickets[key].deadline < now:
                log.info("%s did not answer task %d.%d by its deadline; it may get a new one", unit, *key)
                del self.working[unit]
        for key, ticket in list(self.tickets.items()):
            if ticket.deadline + self.round_timeout < now:
                del self.tickets[key]
                self.answered_by.pop(key, None)
        self.retire_releases(engine)

    def leave(self, current: Round, unit: str) -> None:
        """`unit` will not answer (revoked): its task is void, its slot free for another device."""
        key = self.working.pop(unit, None)
        if key is not None:
            self.tickets.pop(key, None)
        current.cohort.discard(unit)

    def retire_releases(self, engine: Engine) -> None:
        """Older versions stay retained while a task out trains from them (and within S versions)."""
        needed = {self.tickets[key].version for key in self.working.values()}
        engine.releases.retire(engine.transport, engine.version, needed, engine.version - self.max_staleness)

    def _stale_by(self, version: int, what: str) -> int:
        staleness = self.version() - version
        if staleness > self.max_staleness:
            raise Rejected("too_stale", f"{what} was trained on model version {version}; the server is at "
                                        f"version {self.version()}, {staleness} versions later, and accepts at most "
                                        f"{self.max_staleness} ([schedule] max_staleness)")
        return staleness

    # the intake's buffered rules (intake.Freshness) -----------------------------------
    def check(self, current: Round | None, device: str, answer: messages.Answer, arrived: float) -> None:
        """The answer must be to a task this device holds; an update must be trained on the version the
        task named and at most S versions behind. Consumes the ticket: whatever becomes of the answer,
        the task is done and the device may get another."""
        key = (answer.round, answer.attempt)
        ticket = self.tickets.get(key)
        if ticket is None:
            raise Rejected("stale", f"no task {key[0]}.{key[1]} is open: it was answered, expired long ago, or "
                                    "was sent before the coordinator restarted")
        if ticket.unit != device:
            raise Rejected("not_selected", f"task {key[0]}.{key[1]} was sent to {ticket.unit}, not {device}")
        del self.tickets[key]
        if self.working.get(device) == key:
            del self.working[device]
        if arrived > ticket.deadline:
            raise Rejected("late", f"task {key[0]}.{key[1]} was due at {clock(ticket.deadline)}, the answer "
                                   f"arrived {clock(arrived)}")
        if isinstance(answer, messages.Refusal):
            return
        if self.private and current is not None and device in current.answered:
            raise Rejected("duplicate", f"{device} already has an update in version {current.number}'s buffer "
                                        "([privacy]: one update per device per version)")
        if answer.model_version != ticket.version:
            raise Rejected("stale", f"update was trained on model version {answer.model_version}, its task named "
                                    f"version {ticket.version}")
        self._stale_by(ticket.version, "update")

    def factor(self, update: messages.Update) -> float:
        return staleness_factor(self.staleness_weight, self.version() - update.model_version)

    def folded(self, current: Round, device: str, update: messages.Update, weight: float) -> None:
        factor, staleness = self.factor(update), self.version() - update.model_version
        current.aggregate.damp(weight, factor, staleness)  # type: ignore[attr-defined]
        current.device_metrics[device].update(staleness=staleness, staleness_factor=round(factor, 4))
        self.in_buffer.add((update.round, update.attempt))

    def books_to(self, current: Round | None, answered: tuple[int, int]) -> Round | None:
        return current  # every answer is to a task of some version: it counts against the buffer it met

    def still_open(self, current: Round | None, round_no: int, attempt: int) -> bool:
        return current is not None and (round_no, attempt) in self.in_buffer

    # a site's partials ----------------------------------------------------------------
    def check_partial(self, engine: Engine, current: Round | None, site: str, partial: Partial) -> int | None:
        """The partial must answer an open ticket of this site, once per worker, for the version the
        task named, at most S versions behind; its staleness. The ticket is done (the site free for
        the next task) when every worker has answered."""
        workers = engine.topology.sites[site].workers
        key = (partial.round, partial.attempt)
        ticket = self.tickets.get(key)
        if ticket is None or ticket.unit != site:
            raise Rejected("stale", f"no task {key[0]}.{key[1]} of site {site} is open: answered, expired, or "
                                    "sent before the coordinator restarted")
        if not 0 <= partial.worker < workers:
            raise Rejected("not_selected", f"worker {partial.worker} of site {site} was not expected "
                                           f"({workers} workers configured)")
        answered = self.answered_by.setdefault(key, set())
        if partial.worker in answered:
            raise Rejected("duplicate", f"worker {partial.worker} of site {site} already answered task "
                                        f"{key[0]}.{key[1]}")
        answered.add(partial.worker)
        if len(answered) >= workers:  # the site's task is done: it may get the next one
            del self.tickets[key]
            self.answered_by.pop(key, None)
            if self.working.get(site) == key:
                del self.working[site]
        if time.time() > ticket.deadline:
            raise Rejected("late", f"task {key[0]}.{key[1]} of site {site} was due {ticket.deadline - time.time():.0f} s ago")
        if partial.model_version != ticket.version:
            raise Rejected("stale", f"partial folds updates to version {partial.model_version}, its task named "
                                    f"version {ticket.version}")
        return self._stale_by(ticket.version, f"partial of site {site}")
