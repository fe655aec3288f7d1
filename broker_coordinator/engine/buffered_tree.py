"""Buffered versions through sites (`mode = "buffered"` with `[sites.*]`): FedBuff whose unit of
work is a site task instead of a device task.

The centre runs the buffered schedule of `buffered.BufferedCoordinator` over sites: a site that
is online with eligible devices and holds no site task gets one (a ticket: the version being
built, a task number, the version it trains from, a deadline). Its workers run the site task
exactly as in a sync tree (`site_aggregator`: the site's cohort, the same streaming fold and
verdicts) and send their partials. The centre folds each partial of an open ticket into the
buffer with the staleness factor f(s) of the version its task named (s versions behind, dropped
as `too_stale` beyond `max_staleness`), and applies the buffer as the next version once it holds
K (`buffer_size`) device updates:
    step = sum_sites f(s_j) S_j / sum_sites W_j
with S_j, W_j a partial's weighted sum and weight: FedBuff's damping, as the flat buffered fold
applies it per update. A site's ticket is done when each of its workers has sent a partial (or
at its deadline); the site may then get the next task, naming the newest version. Site tasks
never reuse a (round, attempt) for a site, so a worker opens them in order.

Nothing changes at the sites: a worker cannot tell a buffered centre from a sync one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from broker_coordinator.aggregation.damping import Damped
from broker_coordinator.aggregation.staleness import staleness_factor
from broker_coordinator.engine.buffered import BufferedCoordinator, Ticket
from broker_coordinator.engine.coordinator import Coordinator
from broker_coordinator.engine.rounds import Round, RoundState
from broker_coordinator.engine.site_aggregator import site_rules
from broker_coordinator.engine.tree import TreeCoordinator, quotas, site_margin
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import (
    Partial,
    SiteTask,
    decode_partial,
    encode_center,
    encode_site_task,
)
from edgefl_protocol.topics import site_topic

log = logging.getLogger("broker_coordinator")


def tree_class(settings: RoundSettings) -> type[Coordinator]:
    """The coordinator of a federation in sites that runs `settings.mode`."""
    return BufferedTreeCoordinator if settings.mode == "buffered" else TreeCoordinator


class BufferedTreeCoordinator(BufferedCoordinator, TreeCoordinator):
    """`BufferedCoordinator`'s loop (`run_round`, `_expire`, releases kept while tickets need them)
    with sites in place of devices (`TreeCoordinator`'s presence, `eligible`, `_drain`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answered_by: dict[tuple[int, int], set[int]] = {}  # ticket -> workers whose partial came

    def _open_buffer(self, round_no: int) -> Round:
        s = self.settings
        rnd = self._open_round(round_no, 1, set(), time.time() + s.round_timeout, self.population())
        tree_sum = self.tree_sum(round_no, {})
        self.extras = tree_sum.extras
        rnd.aggregate = Damped(tree_sum, scale_step=False)
        self.folded = set()
        self._set_state(rnd, RoundState.COLLECTING)
        return rnd

    def _dispatch(self, buffer: Round) -> None:
        """A site task for every online site with eligible devices and no task out."""
        s = self.settings
        idle = [site for site in self.eligible() if site not in self.working]
        if not idle:
            return
        online = {site: int(self.online[site].get("online", 0) or 0) for site in idle}
        share = quotas(s.clients_per_round, online) if s.clients_per_round else {site: 0 for site in idle}
        deadline = time.time() + s.round_timeout
        self._publish_model(deadline)
        hparams, broadcast = s.task_hparams(buffer.number), self.server_rule.broadcast()
        center_specs, center = encode_center(self.center if s.aggregator == "centered_clip" else None)
        payloads = []
        for site, k in sorted(share.items()):
            attempt = self._next_attempt(buffer.number)
            task = messages.Task(buffer.number, self.version, deadline - site_margin(s.round_timeout), s.algorithm,
                                 hparams, broadcast, s.codec, attempt, self.objective.task, self.objective.loss,
                                 evaluate=self.evaluate_devices)
            self.tickets[(buffer.number, attempt)] = Ticket(site, self.version, deadline)
            self.working[site] = (buffer.number, attempt)
            self.answered_by[(buffer.number, attempt)] = set()
            buffer.cohort.add(site)
            payloads.append((site_topic(self.fed, site, "task"),
                             encode_site_task(SiteTask(buffer.number, attempt, k, messages.encode("task", task),
                                                       site_rules(s), center_specs, center))))
        assert self.session is not None
        for topic in self.session.publish_all(payloads, min(deadline, time.time() + 60)):
            log.error("version %d: the task for site %s could not be published", buffer.number, topic.split("/")[3])

    def _on_partial(self, current: Round | None, site: str, payload: bytes) -> None:
        who = f"site {site}"
        try:
            partial, sums = decode_partial(payload, self.sites[site].key, site, self.specs, self.extra_specs,
                                           self.max_partial_bytes)
            staleness = self._check_ticket(site, partial)
        except Rejected as exc:
            self._reject(who, exc.reason, exc.detail, current)
            return
        assert current is not None
        factor = staleness_factor(self.settings.staleness_weight, staleness)
        current.aggregate.add_partial(partial, sums, factor, staleness)
        sender = f"{site}/{partial.worker}"
        self._book_partial(current, site, sender, partial)
        current.device_metrics[sender].update(staleness=staleness, staleness_factor=round(factor, 4))
        log.info("version %d: partial from worker %d of site %s: %d updates trained on version %d (staleness %d)",
                 current.number, partial.worker, site, partial.count, partial.model_version, staleness)

    def _check_ticket(self, site: str, partial: Partial) -> int:
        """The partial must answer an open ticket of this site, once per worker, for the version the
        task named, at most S versions behind; its staleness. The ticket is done (the site free for
        the next task) when every worker has answered."""
        if partial.federation != self.fed:
            raise Rejected("federation", f"partial is for federation {partial.federation!r}")
        key = (partial.round, partial.attempt)
        ticket = self.tickets.get(key)
        if ticket is None or ticket.device != site:
            raise Rejected("stale", f"no task {key[0]}.{key[1]} of site {site} is open: answered, expired, or "
                                    "sent before the coordinator restarted")
        if not 0 <= partial.worker < self.sites[site].workers:
            raise Rejected("not_selected", f"worker {partial.worker} of site {site} was not expected "
                                           f"({self.sites[site].workers} workers configured)")
        answered = self.answered_by.setdefault(key, set())
        if partial.worker in answered:
            raise Rejected("duplicate", f"worker {partial.worker} of site {site} already answered task "
                                        f"{key[0]}.{key[1]}")
        answered.add(partial.worker)
        if len(answered) >= self.sites[site].workers:  # the site's task is done: it may get the next one
            del self.tickets[key]
            self.answered_by.pop(key, None)
            if self.working.get(site) == key:
                del self.working[site]
        if time.time() > ticket.deadline:
            raise Rejected("late", f"task {key[0]}.{key[1]} of site {site} was due {ticket.deadline - time.time():.0f} s ago")
        if partial.model_version != ticket.version:
            raise Rejected("stale", f"partial folds updates to version {partial.model_version}, its task named "
                                    f"version {ticket.version}")
        staleness = self.version - ticket.version
        if staleness > self.settings.max_staleness:
            raise Rejected("too_stale", f"partial of site {site} folds updates to version {ticket.version}; the "
                                        f"server is at version {self.version}, {staleness} versions later, and "
                                        f"accepts at most {self.settings.max_staleness} ([rounds] max_staleness)")
        return staleness
