"""A federation in sites: the engine tasks sites, not devices, and combines partials (`Sites`).

Per round attempt it publishes the model once (retained; each site's bridge carries it once and
the site broker keeps it retained for its devices), one site task per site with how many devices
that site selects (the round's `clients_per_round` split over the sites in proportion to their
eligible devices), and then waits for one signed partial from every worker of every tasked site.
The round closes when all partials are in, or at its deadline with a quorum of device updates
(`min_updates`, counted over the partials), and concludes exactly as a flat round: the server
rule, evaluation, checkpoint. What crosses the central broker per round does not grow with the
number of devices: a site task and a partial per worker (see `partials`).

The sites close their share `site_margin` seconds before the round's deadline (the device tasks
name that earlier deadline), so that their partials are up in time.

The sites run the round's streaming fold (`robust.STREAMING`), with the centre the coordinator
sends in each site task; what does not run in sites is `composition`'s to say.

In buffered mode (`buffered.BufferedVersions`) a site task is a ticket, and a partial is folded
with the staleness factor of the version its task named.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from broker_coordinator.access.sites import partial_allowance
from broker_coordinator.aggregation.private_partials import PrivateTreeSum
from broker_coordinator.aggregation.robust import OUTLIER_SHARE
from broker_coordinator.aggregation.tree_sum import TreeSum
from broker_coordinator.aggregation.damping import Damped
from broker_coordinator.aggregation.fold import Fold
from broker_coordinator.aggregation.staleness import staleness_factor
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.engine.presence import SitePresence, count_of
from broker_coordinator.engine.rounds import Round
from broker_coordinator.engine.site_aggregator import site_rules
from broker_coordinator.settings.choices import STREAMING
from broker_coordinator.settings.round_settings import RoundRecord
from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import Partial, SiteTask, decode_partial, encode_center, encode_site_task
from edgefl_protocol.topics import all_site_topics, parse_site_topic, site_topic

if TYPE_CHECKING:
    from broker_coordinator.engine.buffered import BufferedVersions
    from broker_coordinator.engine.loop import Engine

log = logging.getLogger("broker_coordinator")


def site_margin(round_timeout: float) -> float:
    """Seconds between a site's deadline and the round's: room for the partials to come up."""
    return min(5.0, 0.2 * round_timeout)


def partial_cap(update_cap: int) -> int:
    """Bytes: the largest partial the coordinator accepts (the sums as float32, like an update's cap,
    plus the per-device rows of a rule that keeps per-device state)."""
    return update_cap + partial_allowance()


@dataclass
class SiteSpec:
    workers: int
    key: bytes  # signs the site's partials
    devices: int = 0  # the registry's count of the site's devices (0: unknown; the round's quota bounds it)


def quotas(clients: int, devices: Mapping[str, int]) -> dict[str, int]:
    """`clients` devices split over sites in proportion to their devices (largest remainder, never
    more than a site has); 0 = every eligible device everywhere."""
    if clients == 0:
        return {site: 0 for site, n in devices.items() if n > 0}
    total = sum(devices.values())
    if total == 0:
        return {}
    clients = min(clients, total)
    exact = {site: clients * n / total for site, n in devices.items()}
    share = {site: int(x) for site, x in exact.items()}
    for site in sorted(exact, key=lambda s: (share[s] - exact[s], s))[:clients - sum(share.values())]:
        share[site] += 1
    return {site: n for site, n in share.items() if n > 0}


def site_tensors(engine: Engine, round_no: int) -> tuple[list, bytes, list, bytes]:
    """What a site task carries beside its rules, coded: centered_clip's centre and root_trust's root
    update (each empty when the fold has none)."""
    s = engine.settings
    return (*encode_center(engine.center if s.aggregator == "centered_clip" else None),
            *encode_center(engine.root_step(round_no) if s.root_trust else None))


class Sites:
    def __init__(self, sites: Mapping[str, SiteSpec], max_update_bytes: int) -> None:
        if not sites:
            raise ValueError("a federation in sites needs at least one [sites.NAME] section")
        self.sites = dict(sites)
        self.presence = SitePresence()
        self.max_partial_bytes = partial_cap(max_update_bytes)
        # site -> share of its weight it keeps (TreeSum), checkpointed with the devices' standing
        self.site_standing: dict[str, float] = {}

    def trust_state(self) -> dict[str, Any]:
        return {"site_standing": dict(self.site_standing)}

    def load_trust(self, trust: Mapping[str, Any]) -> None:
        self.site_standing = {str(site): float(v) for site, v in (trust.get("site_standing") or {}).items()
                              if site in self.sites}

    def tree_sum(self, engine: Engine, round_no: int, share: Mapping[str, int]) -> TreeSum | PrivateTreeSum:
        """The round's aggregate of partials, each site bounded as one more device of the centre (see
        `TreeSum`): at most its quota (or the registry's count of its devices) of updates, a weight and a
        length against the other sites'. With [privacy], the private sum of clipped sums instead, noised
        once at the close (aggregation/private_partials.py: these bounds stay out of the private path)."""
        if engine.privacy:
            return engine.privacy.tree_fold(engine.specs)
        s = engine.settings
        allowed = {site: share.get(site) or spec.devices for site, spec in self.sites.items()}
        return TreeSum(engine.specs, s.normalize_steps, engine.extra_specs, round_no=round_no, allowed=allowed,
                       center=engine.center if s.aggregator == "centered_clip" else None, weighting=s.weighting,
                       weight_cap=s.weight_cap, norm_bound=s.norm_bound,
                       outlier_share=OUTLIER_SHARE if s.aggregator == "centered_clip" else None,
                       standing=self.site_standing,
                       sign_quorum=s.sign_quorum if s.aggregator in STREAMING else 0.0)

    def subscriptions(self, fed: str) -> list[tuple[str, int]]:
        return [(all_site_topics(fed, "status"), 1), (all_site_topics(fed, "partial"), 1)]

    def handle(self, engine: Engine, topic: str, payload: bytes, arrived: float, retained: bool,
               current: Round | None) -> None:
        parsed = parse_site_topic(topic)
        if parsed is None or parsed[0] != engine.fed:
            return
        _, site, kind = parsed
        if site not in self.sites:
            engine.intake.reject(f"site {site}", "unknown_site", f"site {site!r} is not in the config's [sites]",
                                 current)
        elif kind == "status":
            self.presence.on_status(site, payload)
        elif kind == "partial" and payload:
            self.on_partial(engine, current, site, payload)

    # sync rounds ---------------------------------------------------------------------------
    def open(self, engine: Engine, round_no: int, attempt: int, deadline: float) -> tuple[Round, int]:
        s, presence = engine.settings, self.presence
        # in proportion to the sites' online devices: their eligible counts lag (a site reports them at
        # most once a second, and its devices are busy until their receipts); a site selects at most
        # the devices it has eligible when its task arrives
        share = quotas(s.clients_per_round, {site: count_of(presence.online[site], "online")
                                             for site in presence.eligible()})
        if engine.privacy:  # the sites draw the cohort (private_partials)
            share = engine.privacy.site_shares(share, {site: count_of(presence.online[site], "eligible")
                                                       for site in presence.eligible()})
        expected = {f"{site}/{w}" for site in share for w in range(self.sites[site].workers)}
        rnd = engine.open_round(round_no, attempt, expected, deadline, presence.population(),
                                lambda: self.fold(engine, round_no, share))
        rnd.shares = dict(share)
        offered = sum(share.values()) if s.clients_per_round else presence.eligible_devices()
        return rnd, offered

    def fold(self, engine: Engine, round_no: int, share: Mapping[str, int]) -> tuple[Fold, StreamingMean | None]:
        tree_sum = self.tree_sum(engine, round_no, share)
        return tree_sum, tree_sum.extras

    def too_few(self, offered: int, quorum: int) -> str:
        return f"only {offered} devices online and idle at the sites, quorum is {quorum}"

    def task_deadline(self, deadline: float, round_timeout: float) -> float:
        return deadline - site_margin(round_timeout)

    def send_tasks(self, engine: Engine, rnd: Round, task: messages.Task, deadline: float) -> list[str]:
        s = engine.settings
        rules = {**site_rules(s), **(engine.privacy.site_privacy().rules() if engine.privacy else {})}
        tensors = site_tensors(engine, rnd.number)
        payload = messages.encode("task", task)
        unsent = engine.transport.publish_all(
            [(site_topic(engine.fed, site, "task"),
              encode_site_task(SiteTask(rnd.number, rnd.attempt, k, payload, rules, *tensors)))
             for site, k in sorted(rnd.shares.items())],
            min(deadline, time.time() + 60))
        for topic in unsent:
            log.error("round %d: the task for site %s could not be published", rnd.number, topic.split("/")[3])
        return unsent

    def counted(self, rnd: Round) -> int:
        """Devices that count towards the quorum: updates folded, or (evaluation-only) devices reporting."""
        if rnd.train:
            return rnd.aggregate.count
        return sum(m.get("evaluated", 0) for m in rnd.device_metrics.values())

    def closed_because(self, rnd: Round) -> str:
        return ("every site sent its partials" if rnd.complete
                else f"deadline passed with {len(rnd.answered)} of {len(rnd.cohort)} partials")

    def short_because(self, rnd: Round, count: int, quorum: int) -> str:
        return (f"{count} updates in {len(rnd.answered)} of {len(rnd.cohort)} partials at the deadline, "
                f"quorum is {quorum}")

    # partials ------------------------------------------------------------------------------
    def on_partial(self, engine: Engine, current: Round | None, site: str, payload: bytes) -> None:
        """Validate a site's partial against the schedule's rules and add it to the open fold."""
        who = f"site {site}"
        try:
            partial, sums = decode_partial(payload, self.sites[site].key, site, engine.specs, engine.extra_specs,
                                           self.max_partial_bytes)
            if partial.federation != engine.fed:
                raise Rejected("federation", f"partial is for federation {partial.federation!r}")
            staleness = engine.schedule.check_partial(engine, current, site, partial)
            if staleness is None and engine.privacy:  # [privacy]: a clipped sum at this round's C, or nothing
                current.aggregate.check(partial, sums)  # type: ignore[union-attr]
        except Rejected as exc:
            engine.intake.reject(who, exc.reason, exc.detail, current)
            return
        assert current is not None
        sender = f"{site}/{partial.worker}"
        if staleness is None:
            current.aggregate.add(partial, sums)
            self.book(engine, current, site, sender, partial)
            log.debug("round %d: partial from worker %d of site %s: %d updates", current.number, partial.worker,
                     site, partial.count)
            return
        factor = staleness_factor(engine.settings.staleness_weight, staleness)
        current.aggregate.add_partial(partial, sums, factor, staleness)  # type: ignore[attr-defined]
        self.book(engine, current, site, sender, partial)
        current.device_metrics[sender].update(staleness=staleness, staleness_factor=round(factor, 4))
        log.debug("version %d: partial from worker %d of site %s: %d updates trained on version %d (staleness %d)",
                 current.number, partial.worker, site, partial.count, partial.model_version, staleness)

    def book(self, engine: Engine, current: Round, site: str, sender: str, partial: Partial) -> None:
        """What a folded partial leaves in the round besides its sums: who answered, the sites'
        rejections, bytes and bounds, its pooled evaluation, the signals the server rule reads."""
        current.answered.add(sender)
        current.rejected.update(partial.rejected)
        current.bytes_up += partial.bytes_up
        current.weights_clipped += partial.clipped.get("weight", 0)
        current.device_metrics[sender] = {"updates": partial.count, "selected": partial.selected,
                                          "refused": partial.refused, "bytes_up": partial.bytes_up}
        if partial.evaluation:  # the site's pooled evaluation: its count-weighted means, federated_score's way
            score, loss, n, devices = partial.evaluation
            current.evaluations[sender] = (score / n, loss / n, int(n))
            current.evaluated[sender] = partial.model_version
            current.device_metrics[sender]["evaluated"] = int(devices)
        for device, num_samples, metrics in partial.observed:
            try:
                engine.server_rule.observe(device, num_samples, metrics)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("site %s: signals of %s not usable by %s: %s", site, device, engine.algorithm.name, exc)
        engine.metrics.accepted.inc(partial.count)
        engine.metrics.bytes_up.inc(partial.bytes_up)

    def amend(self, record: RoundRecord, rnd: Round) -> None:
        report = rnd.aggregate.report()  # counts of devices, not of partials
        record.clipped = dict(report.bounded)
        record.selected = sum(m.get("selected", 0) for m in rnd.device_metrics.values())
        record.participants = self.counted(rnd)
        # the sites' devices report what they received (a measurement, trusted for nothing)
        record.bytes_down = report.bytes_down
        if record.federated:
            record.federated["devices"] = report.reports

    # buffered versions ---------------------------------------------------------------------
    def buffer_fold(self, engine: Engine, round_no: int) -> tuple[Fold, StreamingMean | None]:
        """The buffer's sum of partials, each damped by its staleness as it arrives."""
        tree_sum = self.tree_sum(engine, round_no, {})
        return Damped(tree_sum, scale_step=False), tree_sum.extras

    def dispatch(self, engine: Engine, schedule: BufferedVersions, buffer: Round) -> None:
        """A site task for every online site with eligible devices and no task out."""
        s = engine.settings
        idle = [site for site in self.presence.eligible() if site not in schedule.working]
        if not idle:
            return
        online = {site: count_of(self.presence.online[site], "online") for site in idle}
        share = quotas(s.clients_per_round, online) if s.clients_per_round else {site: 0 for site in idle}
        deadline = time.time() + s.round_timeout
        engine.publish_model(deadline)
        tensors = site_tensors(engine, buffer.number)
        payloads = []
        for site, k in sorted(share.items()):
            attempt = schedule.ticket(engine, site, buffer, deadline)
            schedule.answered_by[(buffer.number, attempt)] = set()
            task = engine.task(buffer.number, attempt, deadline - site_margin(s.round_timeout),
                               evaluate=engine.evaluate_devices)
            payloads.append((site_topic(engine.fed, site, "task"),
                             encode_site_task(SiteTask(buffer.number, attempt, k, messages.encode("task", task),
                                                       site_rules(s), *tensors))))
        for topic in engine.transport.publish_all(payloads, min(deadline, time.time() + 60)):
            log.error("version %d: the task for site %s could not be published", buffer.number,
                      topic.split("/")[3])
