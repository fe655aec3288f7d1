"""The coordinator of a federation in sites: it tasks sites, not devices, and combines partials.

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
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker_coordinator.access.sites import partial_allowance
from broker_coordinator.aggregation.private_partials import PrivateTreeSum
from broker_coordinator.aggregation.robust import OUTLIER_SHARE
from broker_coordinator.aggregation.tree_sum import TreeSum
from broker_coordinator.engine.coordinator import Coordinator, RoundFailed, RoundRecord
from broker_coordinator.engine.rounds import Round, RoundState
from broker_coordinator.engine.site_aggregator import site_rules
from broker_coordinator.settings import composition
from broker_coordinator.settings.choices import STREAMING
from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import SiteTask, decode_partial, encode_center, encode_site_task
from edgefl_protocol.topics import all_site_topics, parse_site_topic, site_topic
from models.objectives import Evaluation

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


class TreeCoordinator(Coordinator):
    def __init__(self, *args: Any, sites: Mapping[str, SiteSpec], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        composition.check(self.settings, "sites")
        if not sites:
            raise ValueError("a federation in sites needs at least one [sites.NAME] section")
        self.sites = dict(sites)
        self.max_partial_bytes = partial_cap(self.max_update_bytes)
        # site -> share of its weight it keeps (TreeSum), checkpointed with the devices' standing
        self.site_standing: dict[str, float] = {str(site): float(v) for site, v in (
            self._resumed_trust.get("site_standing") or {}).items() if site in self.sites}

    def _trust_state(self) -> dict:
        return {**super()._trust_state(), "site_standing": dict(self.site_standing)}

    def tree_sum(self, round_no: int, share: Mapping[str, int]) -> TreeSum | PrivateTreeSum:
        """The round's aggregate of partials, each site bounded as one more device of the centre (see
        `TreeSum`): at most its quota (or the registry's count of its devices) of updates, a weight and a
        length against the other sites'. With [privacy], the private sum of clipped sums instead, noised
        once at the close (aggregation/private_partials.py: these bounds stay out of the private path)."""
        if self.privacy:
            return self.privacy.tree_fold(self.specs)
        s = self.settings
        allowed = {site: share.get(site) or spec.devices for site, spec in self.sites.items()}
        return TreeSum(self.specs, s.normalize_steps, self.extra_specs, round_no=round_no, allowed=allowed,
                       center=self.center if s.aggregator == "centered_clip" else None, weighting=s.weighting,
                       weight_cap=s.weight_cap, norm_bound=s.norm_bound,
                       outlier_share=OUTLIER_SHARE if s.aggregator == "centered_clip" else None,
                       standing=self.site_standing,
                       sign_quorum=s.sign_quorum if s.aggregator in STREAMING else 0.0)

    def _on_connect(self, client) -> None:
        self.inbox.put(("", b"reset-presence", time.time(), False))
        client.subscribe([(all_site_topics(self.fed, "status"), 1), (all_site_topics(self.fed, "partial"), 1)])
        for topic, payload in self._model_payloads:
            client.publish(topic, payload, qos=1, retain=True)

    def _drain(self, timeout: float, current: Round | None = None) -> None:
        try:
            topic, payload, arrived, _ = self.inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return
        if topic == "" and payload == b"reset-presence":
            self.online.clear()
            return
        parsed = parse_site_topic(topic)
        if parsed is None or parsed[0] != self.fed:
            return
        _, site, kind = parsed
        if site not in self.sites:
            self._reject(f"site {site}", "unknown_site", f"site {site!r} is not in the config's [sites]", current)
        elif kind == "status":
            self._on_site_status(site, payload)
        elif kind == "partial" and payload:
            self._on_partial(current, site, payload)

    def _on_site_status(self, site: str, payload: bytes) -> None:
        try:
            status = messages.decode_status(payload) if payload else None
        except Rejected as exc:
            log.warning("status of site %s ignored: %s", site, exc)
            return
        if status is None or status.state != "online":
            self.online.pop(site, None)
        else:
            self.online[site] = dict(status.profile)

    def eligible(self) -> list[str]:
        """Sites online with at least one eligible device."""
        return [s for s, p in self.online.items() if _count(p, "eligible") > 0]

    def population(self) -> int:
        return sum(_count(p, "online") for p in self.online.values())

    # rounds -------------------------------------------------------------------------------
    def _attempt(self, round_no: int, attempt: int) -> Round:
        s = self.settings
        if not self._presence_settled:
            self._settle_presence()
        deadline = time.time() + s.round_timeout
        while (self._eligible_devices() < s.min_updates and time.time() < deadline
               and not self.stopping.is_set()):
            self._drain(min(0.5, deadline - time.time()))
        # in proportion to the sites' online devices: their eligible counts lag (a site reports them at
        # most once a second, and its devices are busy until their receipts); a site selects at most
        # the devices it has eligible when its task arrives
        share = quotas(s.clients_per_round, {site: _count(self.online[site], "online") for site in self.eligible()})
        if self.privacy:  # the sites draw the cohort (private_partials)
            share = self.privacy.site_shares(share, {site: _count(self.online[site], "eligible")
                                                     for site in self.eligible()})
        expected = {f"{site}/{w}" for site in share for w in range(self.sites[site].workers)}
        rnd = self._open_round(round_no, attempt, expected, deadline, self.population())
        rnd.aggregate = self.tree_sum(round_no, share)  # type: ignore[assignment]
        rnd.train = not s.evaluation_only(round_no)
        self.extras = rnd.aggregate.extras
        if self.on_state:
            self.on_state(rnd)
        offered = sum(share.values()) if s.clients_per_round else self._eligible_devices()
        if offered < s.min_updates:
            self._set_state(rnd, RoundState.ABANDONED, f"only {offered} devices online and idle at the sites, "
                                                       f"quorum is {s.min_updates}")
            return rnd
        self._publish_model(deadline)
        task = messages.Task(round_no, self.version, deadline - site_margin(s.round_timeout), s.algorithm,
                             s.task_hparams(round_no), self.server_rule.broadcast(), s.codec, attempt,
                             self.objective.task, self.objective.loss,
                             evaluate=self.evaluate_devices or not rnd.train, train=rnd.train)
        rules = {**site_rules(s), **(self.privacy.site_privacy().rules() if self.privacy else {})}
        center_specs, center = encode_center(self.center if s.aggregator == "centered_clip" else None)
        payload = messages.encode("task", task)
        assert self.session is not None
        unsent = self.session.publish_all(
            [(site_topic(self.fed, site, "task"),
              encode_site_task(SiteTask(round_no, attempt, k, payload, rules, center_specs, center))) for site, k in sorted(share.items())],
            min(deadline, time.time() + 60))
        for topic in unsent:
            log.error("round %d: the task for site %s could not be published", round_no, topic.split("/")[3])
        self._collect(rnd, deadline)
        count = _devices_counted(rnd)
        if self.stopping.is_set():
            self._set_state(rnd, RoundState.ABANDONED, "coordinator shutting down")
        elif count >= s.min_updates:
            self._set_state(rnd, RoundState.CLOSED, "every site sent its partials" if rnd.complete
                            else f"deadline passed with {len(rnd.answered)} of {len(expected)} partials")
        else:
            self._set_state(rnd, RoundState.ABANDONED, f"{count} updates in {len(rnd.answered)} of {len(expected)} "
                                                       f"partials at the deadline, quorum is {s.min_updates}")
        return rnd

    def _eligible_devices(self) -> int:
        return sum(_count(self.online[site], "eligible") for site in self.eligible())

    def _on_partial(self, current: Round | None, site: str, payload: bytes) -> None:
        who = f"site {site}"
        try:
            partial, sums = decode_partial(payload, self.sites[site].key, site, self.specs, self.extra_specs,
                                           self.max_partial_bytes)
            if partial.federation != self.fed:
                raise Rejected("federation", f"partial is for federation {partial.federation!r}")
            if current is None or (partial.round, partial.attempt) != (current.number, current.attempt):
                open_round = f"round {current.number} (attempt {current.attempt}) is open" if current else "none is open"
                raise Rejected("stale", f"partial is for round {partial.round} (attempt {partial.attempt}); {open_round}")
            sender = f"{site}/{partial.worker}"
            if sender not in current.cohort:
                raise Rejected("not_selected", f"worker {partial.worker} of site {site} was not expected "
                                               f"({self.sites[site].workers} workers configured)")
            if sender in current.answered:
                raise Rejected("duplicate", f"worker {partial.worker} of site {site} already sent its partial")
            if partial.model_version != current.base_version:
                raise Rejected("stale", f"partial folds updates to version {partial.model_version}, the round "
                                        f"distributed version {current.base_version}")
            if self.privacy:  # [privacy]: a clipped sum at this round's C, or nothing
                current.aggregate.check(partial, sums)
        except Rejected as exc:
            self._reject(who, exc.reason, exc.detail, current)
            return
        current.aggregate.add(partial, sums)
        self._book_partial(current, site, sender, partial)
        log.info("round %d: partial from worker %d of site %s: %d updates", current.number, partial.worker, site,
                 partial.count)

    def _book_partial(self, current: Round, site: str, sender: str, partial: Any) -> None:
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
                self.server_rule.observe(device, num_samples, metrics)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("site %s: signals of %s not usable by %s: %s", site, device, self.algorithm.name, exc)
        self.metrics.accepted.inc(partial.count)
        self.metrics.bytes_up.inc(partial.bytes_up)

    def _record(self, rnd: Round, base_sha: str, model_sha: str, closed: str,
                central: Evaluation | None = None) -> RoundRecord:
        record = super()._record(rnd, base_sha, model_sha, closed, central)
        report = rnd.aggregate.report()  # counts of devices, not of partials
        record.clipped = dict(report.bounded)
        record.selected = sum(m.get("selected", 0) for m in rnd.device_metrics.values())
        record.participants = _devices_counted(rnd)
        # the sites' devices report what they received (a measurement, trusted for nothing)
        record.bytes_down = report.bytes_down
        if record.federated:
            record.federated["devices"] = report.reports
        return record

    def wait_for_devices(self, count: int, timeout: float, progress: Any = None) -> None:
        give_up = time.monotonic() + timeout
        while self._eligible_devices() < count:
            if self.stopping.is_set():
                raise RoundFailed("shutting down")
            if time.monotonic() > give_up:
                raise TimeoutError(f"only {self._eligible_devices()} of {count} devices were online and idle at "
                                   f"the sites within {timeout:.0f} s")
            self._drain(0.2)


def _devices_counted(rnd: Round) -> int:
    """Devices that count towards the quorum: updates folded, or (evaluation-only) devices reporting."""
    if rnd.train:
        return rnd.aggregate.count
    return sum(m.get("evaluated", 0) for m in rnd.device_metrics.values())


def _count(profile: Mapping[str, Any], key: str) -> int:
    value = profile.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
