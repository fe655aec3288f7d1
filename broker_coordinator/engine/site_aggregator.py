"""A site aggregator worker: beside a site broker, it tasks the site's devices, validates and folds
their updates, and sends one signed partial per round attempt up the bridge (see `partials`).

Validation and the fold are the coordinator's own (`intake.UpdateIntake`, `robust.RobustRound`,
`trust`), held by the worker with the terms of each site task. Presence (`presence.DevicePresence`)
is the coordinator's too. Several workers may serve one site: each subscribes to the devices'
updates through a shared subscription (`$share/<group>/...`), so the broker hands every update to
exactly one of them, and each sends a partial of what it folded; the coordinator adds them up.
Worker 0 (the leader) also selects the devices, tasks them and reports the site's presence.

When is a worker's share complete? The leader publishes the round's cohort on a site-local
retained topic before any task goes out; every worker reads it and watches the receipts (which
whichever worker folded an update publishes on the device's receipt topic), so each knows when
every selected device has answered, as the coordinator does in a flat federation, without the
workers talking to each other. Otherwise the task's deadline closes the share.

Trust in a tree: the sample-weight cap and the norm bound are applied per site, against the
history of the site's own devices, and the fold is the round's streaming fold (`robust.STREAMING`:
centered_clip, by default, around the centre the site task carries, or mean), judged update by
update exactly as at the centre, and each device's receipt carries the fold's verdict on its
update, as the coordinator's does (`verdicts`). The coordinate-wise median that gated_mean, trimmed_mean and
median need is not a sum, so a partial cannot carry it (`composition` refuses them in sites).
The site's trust history lives in the worker's memory: a restarted worker starts cold (equal
weights and its first round's own median norm, as a fresh coordinator does).

With `[privacy] mode = "central"` the site task's rules carry the round's clip and sampling: the
leader draws the cohort with the CSPRNG and the workers fold with the private fold without noise,
forwarding clipped sums; the centre adds the noise (`private_partials`).

Selection at a site is the round's (`selection.select` with the policy the site task's rules
name, `random` or `stability`), over the site's eligible devices and the last metrics the leader
folded from them. With several workers the leader knows only the metrics of the updates it folded
itself; a device whose metrics went to another worker counts as one with no history (eligible,
as `stability` treats any newcomer).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from broker_coordinator.aggregation.consensus import Consensus
from broker_coordinator.aggregation.privacy import PrivateRound
from broker_coordinator.aggregation.reference import carried_root_update
from broker_coordinator.aggregation.private_partials import partial_fields, site_privacy
from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.aggregation.votes import vote_fields
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import NormBound, SampleWeights
from broker_coordinator.engine.intake import Terms, UpdateIntake
from broker_coordinator.engine.presence import DevicePresence
from broker_coordinator.engine.sync_rounds import RoundFreshness
from broker_coordinator.engine.transport import InMemoryTransport, MqttTransport, Transport
from broker_coordinator.engine.rounds import Round, RoundState
from broker_coordinator.engine.selection import POLICIES, select
from broker_coordinator.engine.verdicts import Verdicts
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_protocol import algorithms, codec, messages, protocol, topics
from edgefl_protocol.algorithms.base import ServerRule
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import (
    Partial,
    SiteTask,
    decode_center,
    decode_site_task,
    encode_partial,
    make_partial,
    pooled_evaluation,
    site_task_cap,
    summarize,
)
from edgefl_protocol.topics import site_topic
from edgefl_models.architectures import build_model, get_weights
from edgefl_models.objectives import Objective

log = logging.getLogger("broker_coordinator.site")
TRUST_RULES = ("max_update_norm", "weighting", "weight_cap", "norm_bound", "normalize_steps", "aggregator",
               "sign_quorum", "kinship", "agreement_floor", "agreement_flags", "verdict_banks", "root_trust")
STATUS_EVERY = 1.0  # seconds between the leader's presence reports, at most


def site_rules(settings: RoundSettings) -> dict[str, Any]:
    """What a site task carries of the round's settings: the trust rules its workers apply, and the
    selection policy its leader draws the site's cohort with."""
    return {**{name: getattr(settings, name) for name in TRUST_RULES}, "selection": settings.selection}


def share_topic(group: str, topic: str) -> str:
    """An MQTT v5 shared subscription: the broker gives each message to one member of `group`."""
    return f"$share/{group}/{topic}"


class ReadKeys(dict):
    """A device's metrics that note which keys the server rule looks at."""

    def __init__(self, metrics: Mapping[str, Any], reads: set[str]) -> None:
        super().__init__(metrics)
        self.reads = reads

    def __getitem__(self, key: str) -> Any:
        self.reads.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.reads.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.reads.add(str(key))
        return super().__contains__(key)


class SiteRule:
    """The algorithm's server rule at a site: it weighs updates as the coordinator's would; what it
    observes is only noted, so that a partial carries, per device, just the metrics the rule reads
    (dynsam: sigma and gamma, 26 bytes a device instead of about 180 with every metric)."""

    def __init__(self, rule: ServerRule) -> None:
        self.rule = rule
        self.reads: set[str] = set()
        self.per_device = type(rule).observe is not ServerRule.observe  # keeps per-device state?

    def start_round(self, round_no: int, population: int) -> None:
        self.rule.start_round(round_no, population)

    def extra_specs(self, specs: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return self.rule.extra_specs(specs)

    def weight(self, num_samples: float, metrics: Mapping[str, Any]) -> float:
        return self.rule.weight(num_samples, metrics)

    def observe(self, device: str, num_samples: int, metrics: Mapping[str, Any]) -> None:
        self.rule.observe(device, num_samples, ReadKeys(metrics, self.reads))


class SiteWorker:
    """One worker of a site: the coordinator's presence, intake and fold on the site's devices."""

    def __init__(self, federation: str, site: str, arch: str, site_key: bytes, device_keys: dict[str, bytes],
                 worker: int = 0, share_group: str = "edgefl", seed: int = 0) -> None:
        self.fed = topics.check_name("federation", federation)
        self.site = topics.check_name("site", site)
        self.worker, self.share_group, self.site_key = worker, share_group, site_key
        self.specs = codec.specs_of(get_weights(build_model(arch)))
        self.metrics = Metrics()
        self.verdicts = Verdicts()  # the same verdict receipts as the coordinator's (engine/verdicts.py)
        self.presence = DevicePresence(None, self.metrics)  # as the coordinator's, from the same retained statuses
        self.transport: Transport = InMemoryTransport()  # until `connect`
        self.sample_weights = SampleWeights()
        self.norm_bound = NormBound()
        self.radius = NormBound.radius(1.5)  # centered_clip: distances of this site's devices from the round's centre
        self.consensus = Consensus()  # centered_clip: its devices' standing by agreement with their rounds
        self.server_rule: SiteRule | Any = None  # the round's (each site task names its algorithm)
        closed_at: dict[int, float] = {}
        settings = RoundSettings(aggregator="mean")
        algorithm = algorithms.get(settings.algorithm)
        terms = Terms(settings, Objective(), algorithm.server(settings.task_hparams(1)), algorithm.name, self.specs,
                      {}, self.sample_weights)
        # the centre releases the models: no release hash to check updates against
        self.intake = UpdateIntake(self.fed, terms, device_keys, self.presence, RoundFreshness(closed_at),
                                   self.verdicts, self.metrics, None,
                                   lambda topic, payload: self.transport.publish(topic, payload), {}, closed_at)
        self.rules: dict[str, Any] | None = None
        self.rng = random.Random(f"{seed}/{site}")
        self.current: Round | None = None
        self.sent: set[tuple[int, int]] = set()  # (round, attempt) whose partial went up
        self.seen: set[str] = set()  # devices of the current round with an accepting receipt
        self.partials_sent = 0
        self.stopping = threading.Event()
        self._status_at, self._status_sent = 0.0, None

    @property
    def leader(self) -> bool:
        return self.worker == 0

    # session -----------------------------------------------------------------------------
    def connect(self, host: str, port: int, username: str, password: str, tls_ca: str | None = None,
                timeout: float = 30.0) -> None:
        will = (site_topic(self.fed, self.site, "status"),
                messages.encode("status", messages.Status(self.site, "offline"))) if self.leader else None
        transport = MqttTransport(username, username, password, host, port, on_connect=self._on_connect,
                                  will=will, tls_ca=tls_ca, session_expiry=3600, max_queued=0)
        self.transport = transport
        transport.start(timeout)

    def _on_connect(self, client) -> None:  # noqa: ANN001 (paho client, on paho's thread)
        subs = [(share_topic(self.share_group, topics.all_updates(self.fed)), 1),
                (site_topic(self.fed, self.site, "cohort"), 1),
                (f"{topics.ROOT}/{self.fed}/device/+/receipt", 1)]
        if self.leader:
            subs += [(site_topic(self.fed, self.site, "task"), 1), (topics.all_statuses(self.fed), 1)]
        client.subscribe(subs)

    def close(self) -> None:
        if isinstance(self.transport, MqttTransport):
            last = (site_topic(self.fed, self.site, "status"),
                    messages.encode("status", messages.Status(self.site, "offline"))) if self.leader else None
            self.transport.stop(last)

    # loop --------------------------------------------------------------------------------
    def serve(self, until: threading.Event | None = None) -> None:
        stop = until or self.stopping
        while not stop.is_set():
            self.step(0.2)

    def step(self, timeout: float) -> None:
        """Handle one queued message (or wait up to `timeout`), then what the clock asks for."""
        try:
            topic, payload, arrived, retained = self.transport.inbox.get(timeout=timeout)
        except queue.Empty:
            pass
        else:
            self._handle(topic, payload, arrived, retained)
        rnd = self.current
        if rnd is not None and (rnd.number, rnd.attempt) not in self.sent and time.time() > rnd.deadline:
            self._send_partial(rnd, f"deadline passed with {rnd.aggregate.count} updates folded here")
        if self.leader:
            self._report_presence()

    def _handle(self, topic: str, payload: bytes, arrived: float, retained: bool) -> None:
        if topic == site_topic(self.fed, self.site, "task"):
            if payload:
                self._on_site_task(payload)
            return
        if topic == site_topic(self.fed, self.site, "cohort"):
            if payload:
                self._on_cohort(payload)
            return
        parsed = topics.parse_device_topic(topic)
        if parsed is None or parsed[0] != self.fed:
            return
        _, device, kind = parsed
        if kind == "status":
            self.presence.on_status(device, payload)
            if not payload:  # cleared: revoked, or its key rotated; an answer it sent now would be refused
                self._leaves(device)
        elif kind == "receipt":
            self._on_receipt(device, payload)
        elif kind == "update" and payload and not retained:
            self.intake.on_update(self.current, device, payload, arrived)

    # the leader: a site task becomes a cohort and device tasks -----------------------------
    def _on_site_task(self, payload: bytes) -> None:
        try:
            site_task = decode_site_task(payload, site_task_cap(self.specs))
            task = messages.decode_task(site_task.task)
            privacy = site_privacy(site_task.rules)
        except Rejected as exc:
            log.error("site task ignored: %s", exc)
            return
        key = (site_task.round, site_task.attempt)
        if self.current is not None and key <= (self.current.number, self.current.attempt):
            return  # the retained copy of a task we already serve (a reconnect)
        if task.deadline <= time.time():
            log.warning("site task for round %d (attempt %d) ignored: its deadline has passed", *key)
            return
        eligible = self.presence.eligible()
        k = len(eligible) if site_task.clients == 0 else site_task.clients
        policy = site_task.rules.get("selection", "random")  # random: a coordinator from before it was sent
        if policy not in POLICIES:
            log.error("round %d: the site task names selection %r, not one of %s; selecting at random",
                      site_task.round, policy, ", ".join(POLICIES))
            policy = "random"
        cohort = sorted(privacy.draw(eligible, site_task.clients) if privacy  # the CSPRNG, never self.rng
                        else select(policy, eligible, k, self.rng, self.intake.last_metrics))
        self.presence.tasked(cohort, site_task.round, task.deadline)
        cohort_msg = msgpack.packb({"site_task": payload, "devices": cohort}, use_bin_type=True)
        if not self.transport.publish_until(site_topic(self.fed, self.site, "cohort"), cohort_msg, task.deadline,
                                            retain=True):
            log.error("round %d: could not publish the site's cohort", site_task.round)
            return
        wire = self.intake.wire  # each device's task in the protocol version it speaks
        sealed = [(topics.task(self.fed, d), wire.seal(d, "task", task)) for d in cohort]
        unsent = self.transport.publish_all([(topic, p) for topic, p in sealed if p is not None], task.deadline)
        unsent += [topic for topic, p in sealed if p is None]
        log.info("round %d (attempt %d): tasked %d of %d eligible devices%s", *key, len(cohort) - len(unsent),
                 len(eligible), f"; {len(unsent)} tasks not delivered" if unsent else "")

    # every worker: a cohort opens the site's round ----------------------------------------
    def _on_cohort(self, payload: bytes) -> None:
        try:
            obj = msgpack.unpackb(payload, raw=False)
            site_task = decode_site_task(obj["site_task"], site_task_cap(self.specs))
            task = messages.decode_task(site_task.task)
            site_privacy(site_task.rules)  # a private round is folded privately or not at all
            devices = set(obj["devices"])
        except (Rejected, KeyError, TypeError, ValueError) as exc:
            log.error("site cohort ignored: %s", exc)
            return
        key = (site_task.round, site_task.attempt)
        if self.current is not None and key <= (self.current.number, self.current.attempt):
            return
        previous = self.current
        if previous is not None and (previous.number, previous.attempt) not in self.sent:
            self._send_partial(previous, "superseded by a newer task")
        if previous is not None and previous.number == site_task.round and previous.attempt < site_task.attempt:
            # the centre tasks the round again: the attempt this site folded for made no version, so
            # the devices told "folded" are told "left_out" (they undo their commit, edge_agent.settlement)
            previous.reason = f"the centre abandoned attempt {previous.attempt} and retries as {site_task.attempt}"
            self.intake.abandoned(previous)
        self.current = self.open(site_task, task, devices)
        self.seen = set()
        if not devices:
            self._send_partial(self.current, "no device of the site was eligible")

    def open(self, site_task: SiteTask, task: messages.Task, cohort: set[str]) -> Round:
        """The site's share of a round: its trust rules, the round's server rule, an empty fold."""
        rules = {k: v for k, v in site_task.rules.items() if k in TRUST_RULES}
        if rules != self.rules:  # the trust bounds' history is kept as long as the rules stand
            self.rules = rules
            self.sample_weights = SampleWeights(rules.get("weighting", "capped"), rules.get("weight_cap", 2.0))
            self.norm_bound = NormBound(rules.get("norm_bound", 1.5))
            self.radius = NormBound.radius(rules.get("norm_bound", 1.5))
        rules.setdefault("aggregator", "mean")  # a coordinator from before the centre was sent
        settings = RoundSettings(algorithm=task.algorithm, codec=task.codec, **rules)
        self.consensus.kinship, self.consensus.floor, self.consensus.flags_to_act = (
            settings.kinship, settings.agreement_floor, settings.agreement_flags)
        try:
            center = decode_center(site_task, self.specs)
        except Rejected as exc:
            log.error("round %d: the site task's centre is unusable (%s); folding without one", site_task.round, exc)
            center = None
        trust = carried_root_update(site_task, self.specs) if settings.root_trust else None
        algorithm = algorithms.get(task.algorithm)
        self.server_rule = SiteRule(algorithm.server(task.hparams))
        self.server_rule.start_round(site_task.round, self.presence.population())
        extra_specs = self.server_rule.extra_specs(self.specs)
        self.intake.terms = Terms(settings, Objective.of(task.task, task.loss), self.server_rule, algorithm.name,
                                  self.specs, extra_specs, self.sample_weights)
        self.sample_weights.start_round()
        privacy = site_privacy(site_task.rules)  # [privacy]: clipped to the round's C, the centre adds the noise
        rnd = Round(site_task.round, site_task.attempt, cohort, task.deadline, task.model_version,
                    privacy.fold(self.specs) if privacy else
                    RobustRound(self.specs, self.norm_bound, settings.aggregator,
                                normalize_steps=settings.normalize_steps, center=center, radius=self.radius,
                                consensus=self.consensus, sign_quorum=settings.sign_quorum,
                                verdict_banks=settings.verdict_banks,
                                trust=trust),
                    train=task.train, extras=StreamingMean(extra_specs) if extra_specs else None)
        rnd.move(RoundState.COLLECTING)
        return rnd

    def _on_receipt(self, device: str, payload: bytes) -> None:
        self.presence.pending_until.pop(device, None)  # answered (to whichever worker): no longer busy with it
        rnd = self.current
        if rnd is None or (rnd.number, rnd.attempt) in self.sent or device not in rnd.cohort:
            return
        try:
            receipt = messages.decode_receipt(protocol.unseal(payload, self.intake.keys.get(device), "a site worker"))
        except Rejected:
            return
        if receipt.accepted and (receipt.round, receipt.attempt) == (rnd.number, rnd.attempt):
            self.seen.add(device)
            if self.seen >= rnd.cohort:
                self._send_partial(rnd, "every selected device of the site answered")

    def _leaves(self, device: str) -> None:
        """A device that can no longer answer leaves the site's open round at once."""
        rnd = self.current
        if rnd is None or (rnd.number, rnd.attempt) in self.sent or device not in rnd.cohort or device in self.seen:
            return
        rnd.cohort.discard(device)
        log.info("round %d: %s left the site's round (its status was cleared: revoked or rotated)", rnd.number, device)
        if rnd.cohort and self.seen >= rnd.cohort:
            self._send_partial(rnd, "every remaining selected device of the site answered")

    # up the bridge ------------------------------------------------------------------------
    def partial(self, rnd: Round) -> Partial:
        stream = rnd.aggregate.streamed()
        rule = self.server_rule
        per_device = isinstance(rule, SiteRule) and rule.per_device
        observed = ([[d, int(m.get("num_samples", 0)), {k: v for k, v in m.items() if k in rule.reads}]
                     for d, m in rnd.device_metrics.items()] if per_device else [])
        report = rnd.aggregate.report()
        clipped = {"norm": len(report.clipped)} if report.clipped else {}
        if report.centered:
            clipped["center"] = len(report.centered)
        if report.disagreeing:
            clipped["disagreed"] = len(report.disagreeing)
        if report.judged_kin and self.consensus.kin:
            clipped["kin"] = len(self.consensus.kin)
            for device, (closest, cosine) in self.consensus.kin.items():
                log.warning("round %d: updates from %s depart from their rounds like %s's (path cosine %.3f): "
                            "it weighs %.2f from its next update on", rnd.number, device, closest, cosine,
                            self.consensus.of(device))
        if report.held_back:
            clipped["held_back"] = len(report.held_back)
        if rnd.weights_clipped:
            clipped["weight"] = rnd.weights_clipped
        return make_partial(self.fed, self.site, self.worker, rnd.number, rnd.attempt, rnd.base_version, stream,
                            rnd.extras, rejected=dict(rnd.rejected), refused=len(rnd.refused), clipped=clipped,
                            bytes_up=rnd.bytes_up, summary=summarize(rnd.device_metrics), observed=observed,
                            selected=len(rnd.cohort) if self.leader else 0,
                            evaluation=pooled_evaluation(rnd.evaluations), **vote_fields(rnd.aggregate.votes),
                            **(partial_fields(rnd.aggregate) if isinstance(rnd.aggregate, PrivateRound) else {}))

    def _send_partial(self, rnd: Round, why: str) -> None:
        key = (rnd.number, rnd.attempt)
        self.sent.add(key)
        self.intake.closed(rnd.number)
        partial = self.partial(rnd)
        self.intake.flushed(rnd)  # `partial` flushed any held (cold-start) updates: their final receipts
        payload = encode_partial(partial, self.site_key)
        ok = self.transport.publish_until(site_topic(self.fed, self.site, "partial"), payload, time.time() + 30)
        self.partials_sent += ok
        log.log(logging.INFO if ok else logging.ERROR, "round %d (attempt %d): partial of worker %d %s: %d "
                "updates, %d bytes (%s)", *key, self.worker, "sent" if ok else "NOT sent", partial.count,
                len(payload), why)

    def _report_presence(self) -> None:
        now = time.monotonic()
        if now - self._status_at < STATUS_EVERY or not isinstance(self.transport, MqttTransport):
            return
        # the samples: what a resting federation's coordinator watches for new data ([pacing] new_data)
        profile = {"online": self.presence.population(), "eligible": self.presence.eligible_devices(),
                   "samples": self.presence.samples()}
        if profile != self._status_sent:
            status = messages.Status(self.site, "online", profile)
            self.transport.publish(site_topic(self.fed, self.site, "status"), messages.encode("status", status),
                                   retain=True)
            self._status_sent = profile
        self._status_at = now
