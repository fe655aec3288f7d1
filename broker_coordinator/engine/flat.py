"""A flat federation: the engine tasks devices and folds their updates itself (`intake`).

The other topology is `tree.Sites`, where the units are sites that fold their devices' updates
and send partials. Either is a choice the engine loop is given; the schedule (`sync_rounds`,
`buffered`) asks it for units, folds and tasks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from broker_coordinator.aggregation.damping import Damped
from broker_coordinator.aggregation.fold import Fold
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.engine.presence import DevicePresence
from broker_coordinator.engine.rounds import Round
from broker_coordinator.engine.selection import select
from broker_coordinator.settings.round_settings import RoundRecord
from edgefl_protocol import messages, topics

if TYPE_CHECKING:
    from broker_coordinator.engine.buffered import BufferedVersions
    from broker_coordinator.engine.loop import Engine

log = logging.getLogger("broker_coordinator")


class Devices:
    def __init__(self, presence: DevicePresence) -> None:
        self.presence = presence
        self.sites: dict[str, Any] = {}  # a flat federation has none

    def subscriptions(self, fed: str) -> list[tuple[str, int]]:
        return [(topics.all_updates(fed), 1), (topics.all_statuses(fed), 1)]

    def handle(self, engine: Engine, topic: str, payload: bytes, arrived: float, retained: bool,
               current: Round | None) -> None:
        parsed = topics.parse_device_topic(topic)
        if parsed is None or parsed[0] != engine.fed:
            return
        _, device, kind = parsed
        if kind == "status":
            self.presence.on_status(device, payload)
            if not payload and current is not None:  # a cleared status: revoked, or its key rotated
                self._leaves(engine, current, device)
        elif kind == "update" and retained:
            if payload:  # a device left a retained message on its update topic: it would replay on every
                # reconnect of ours, so it is never an answer; clear it
                engine.intake.reject(device, "retained", "updates must not be retained; cleared it", None)
                engine.transport.publish(topic, b"", retain=True)
        elif kind == "update" and payload:  # an empty payload is our own clearing of a retained one
            engine.intake.on_update(current, device, payload, arrived)

    def _leaves(self, engine: Engine, current: Round, device: str) -> None:
        """A device the registry no longer admits leaves the open round at once: the round does not
        wait for an answer it would reject."""
        refused = self.presence.admission(device) if self.presence.admission else None
        if refused is None or device not in current.cohort or device in current.answered:
            return
        engine.schedule.leave(current, device)
        log.info("round %d: %s left the round: %s: %s", current.number, device, *refused)

    # sync rounds ---------------------------------------------------------------------------
    def open(self, engine: Engine, round_no: int, attempt: int, deadline: float) -> tuple[Round, int]:
        s = engine.settings
        eligible = self.presence.eligible()
        k = len(eligible) if s.clients_per_round == 0 else s.clients_per_round
        cohort = (engine.privacy.cohort(eligible) if engine.privacy
                  else set(select(s.selection, eligible, k, engine.rng, engine.intake.last_metrics)))
        rnd = engine.open_round(round_no, attempt, cohort, deadline, self.presence.population())
        return rnd, len(cohort)

    def fold(self, engine: Engine, round_no: int) -> tuple[Fold, StreamingMean | None]:
        """The round's fold of device updates, and the mean of the algorithm's extra tensors."""
        return engine.update_fold(round_no), StreamingMean(engine.extra_specs) if engine.extra_specs else None

    def too_few(self, offered: int, quorum: int) -> str:
        resting = len(self.presence.not_eligible())  # online, but their owners' conditions say not now
        return (f"only {offered} device(s) online and idle, quorum is {quorum}"
                + (f"; {resting} more online may not train now (`status` says why)" if resting else ""))

    def task_deadline(self, deadline: float, round_timeout: float) -> float:
        return deadline

    def send_tasks(self, engine: Engine, rnd: Round, task: messages.Task, deadline: float) -> list[str]:
        """Every task is confirmed by the broker (PUBACK), retried across reconnects; one never sent is a
        device that cannot answer, and the log says which."""
        # after the deadline the retained status says whether it is still training (busy)
        self.presence.tasked(rnd.cohort, rnd.number, deadline)
        wire = engine.intake.wire  # each device's task in the protocol version it speaks
        sealed = [(topics.task(engine.fed, d), wire.seal(d, "task", task)) for d in sorted(rnd.cohort)]
        unsent = engine.transport.publish_all([(topic, payload) for topic, payload in sealed if payload is not None],
                                              min(deadline, time.time() + 60))
        unsent += [topic for topic, payload in sealed if payload is None]
        for topic in unsent:
            log.error("round %d: the task for %s could not be published", rnd.number, topic.split("/")[3])
        return unsent

    def counted(self, rnd: Round) -> int:
        return rnd.counted

    def closed_because(self, rnd: Round) -> str:
        return ("all selected devices answered" if rnd.complete
                else f"deadline passed with {rnd.counted} of {len(rnd.cohort)} answers")

    def short_because(self, rnd: Round, count: int, quorum: int) -> str:
        answers = "updates" if rnd.train else "evaluation reports"
        return f"{count} of {len(rnd.cohort)} {answers} at the deadline, quorum is {quorum}"

    def amend(self, record: RoundRecord, rnd: Round) -> None:
        """A flat round's record is the intake's and the fold's as they are."""

    def trust_state(self) -> dict[str, Any]:
        return {}

    def load_trust(self, trust: dict[str, Any]) -> None:
        """The devices' standing is the engine's own (sample weights, norms, consensus)."""

    # buffered versions ---------------------------------------------------------------------
    def buffer_fold(self, engine: Engine, round_no: int) -> tuple[Fold, StreamingMean | None]:
        """The buffer's fold: each update damped by its staleness (`Damped`)."""
        fold, extras = self.fold(engine, round_no)
        return Damped(fold, scale_step=True), extras

    def dispatch(self, engine: Engine, schedule: BufferedVersions, buffer: Round) -> None:
        """A task for every idle device without one (at most `clients_per_round` out at a time; 0 = no cap)."""
        s = engine.settings
        # with [privacy], a device lands at most once in a buffer (its sensitivity stays C): no second task
        idle = [d for d in self.presence.eligible()
                if d not in schedule.working and not (engine.privacy and d in buffer.answered)]
        room = (s.clients_per_round - len(schedule.working)) if s.clients_per_round else len(idle)
        if not idle or room <= 0:
            return
        chosen = select(s.selection, idle, room, engine.rng, engine.intake.last_metrics)
        deadline = time.time() + s.round_timeout
        engine.publish_model(deadline)
        payloads = []
        for device in chosen:
            attempt = schedule.ticket(engine, device, buffer, deadline)
            task = engine.task(buffer.number, attempt, deadline, evaluate=engine.evaluate_devices)
            if (payload := engine.intake.wire.seal(device, "task", task)) is not None:
                payloads.append((topics.task(engine.fed, device), payload))
        for topic in engine.transport.publish_all(payloads, min(deadline, time.time() + 60)):
            log.error("version %d: the task for %s could not be published", buffer.number, topic.split("/")[3])
