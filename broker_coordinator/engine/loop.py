"""The engine: one loop that takes a model version from open to applied, whatever it is given.

    Engine(settings, sites=None, transport=None)
      schedule   SyncRounds (a cohort, a deadline, a quorum)  | BufferedVersions (K updates, tickets)
      topology   Devices (flat: device updates)               | Sites (site tasks, partials)
      transport  MqttTransport (paho session)                 | InMemoryTransport (tests, benchmarks)
      parts      presence, intake, releases, records: objects the loop holds

    run_round -> schedule.run_round -> topology.open / dispatch -> transport.publish_all
              -> drain -> topology.handle -> intake.on_update | Sites.on_partial -> fold.add
              -> conclude: fold.result() -> server rule -> server optimizer -> evaluate -> checkpoint

Every decision happens on the thread that calls `run_round`: the transport's thread only queues
what arrives, so nothing here needs a lock. Each version is checkpointed (model, server state,
round record) before the database learns of it, so an engine killed at any point resumes without
applying a version twice (see `store`).

Every answer is hostile until validated (`intake`: signature before parsing, then schema,
freshness, shapes, values; a rejection is logged, counted and never touches the global model).
Every answer gets a receipt on the device's `receipt` topic (the agent resends until it has one),
so nothing a device sent in time is lost without a reason on one side. A valid update is still a
claim: its weight and its length are bounded by what the server has seen (`trust`), and the round
folds it robustly (`robust`), or privately with `[privacy] mode = "central"` (`private_rounds`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.aggregation.consensus import Consensus
from broker_coordinator.aggregation.fold import Fold
from broker_coordinator.aggregation.reference import RootUpdates, flattened
from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.aggregation.server_optimizer import ServerOptimizer
from broker_coordinator.aggregation.serving import ServedAverage
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import NormBound, SampleWeights
from broker_coordinator.engine.buffered import BufferedVersions
from broker_coordinator.engine.flat import Devices
from broker_coordinator.engine.intake import Terms, UpdateIntake
from broker_coordinator.engine.presence import DevicePresence
from broker_coordinator.engine.private_rounds import private_rounds_for
from broker_coordinator.engine.records import RoundRecords, record_row
from broker_coordinator.engine.releases import ModelReleases
from broker_coordinator.engine.rounds import Round, RoundFailed, RoundState
from broker_coordinator.engine.serving import ServingReleases
from broker_coordinator.engine.sync_rounds import SyncRounds
from broker_coordinator.engine.transport import InMemoryTransport, MqttTransport, Transport
from broker_coordinator.engine.tree import Sites, SiteSpec
from broker_coordinator.engine.verdicts import Verdicts
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.settings import composition
from broker_coordinator.settings.round_settings import RoundRecord, RoundSettings
from broker_coordinator.settings.serving_settings import ServingSettings
from broker_coordinator.storage.store import Checkpoint, Store, model_sha256
from broker_coordinator.storage.verdict_journal import VerdictJournal
from edgefl_protocol import OLDEST_SCHEMA, algorithms, codec, delta_downlink, messages, protocol, topics
from edgefl_models.architectures import build_model, fingerprint, get_weights, set_weights
from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Evaluation, Objective

log = logging.getLogger("broker_coordinator")
FoldFactory = Callable[[], "tuple[Fold, StreamingMean | None]"]


class Engine:
    def __init__(self, federation: str, arch: str, test_set: Dataset | None, settings: RoundSettings, seed: int = 0,
                 store: Store | None = None, metrics: Metrics | None = None,
                 on_state: Callable[[Round], None] | None = None,
                 device_keys: Mapping[str, bytes] | None = None, root_set: Dataset | None = None,
                 objective: Objective = Objective(), sites: Mapping[str, SiteSpec] | None = None,
                 transport: Transport | None = None, serving: ServingSettings | None = None,
                 min_protocol: int = OLDEST_SCHEMA) -> None:
        settings.validate()
        if sites is not None:
            composition.check(settings, "sites")
        self.objective = objective
        self.evaluate_central, self.evaluate_devices = settings.evaluation(test_set is not None and len(test_set) > 0)
        if settings.reference == "root" and (root_set is None or len(root_set) == 0):
            raise ValueError("reference = \"root\" needs a small labelled dataset on the coordinator: set "
                             "[federation] root_data (not the test set)")
        if settings.root_trust and (root_set is None or len(root_set) == 0):
            raise ValueError("root_trust = true needs a small labelled dataset on the coordinator: set "
                             "[federation] root_data (100-500 examples the operator trusts, not the test set)")
        if root_set is not None and objective.task != "classification":
            raise ValueError("root_data (the trusted reference) is for classification tasks; unset it for "
                             f"a {objective.task} task")
        self.root = RootUpdates(arch, root_set) if root_set is not None else None
        self.fed = topics.check_name("federation", federation)
        self.arch, self.settings, self.test_set = arch, settings, test_set
        self.store, self.metrics, self.on_state = store, metrics or Metrics(), on_state
        self.transport: Transport = transport or InMemoryTransport()
        self.model = build_model(arch, seed)
        self.weights = get_weights(self.model)
        self.specs = codec.specs_of(self.weights)
        if settings.codec == codec.AUTO:  # what the tasks name, for this model (edgefl_protocol.codec.resolve)
            settings = self.settings = dataclasses.replace(
                settings, codec=codec.resolve(settings.codec, sum(math.prod(s) for s in self.specs.values())))
        self.served = ServedAverage(self.weights, settings.serve_average)  # what is evaluated and kept
        self.served_model = build_model(arch)
        self.version = 0
        self.next_round = 1
        self.algorithm = algorithms.get(settings.algorithm)
        self.server_rule = self.algorithm.server(settings.task_hparams(1))
        self.server_optimizer = ServerOptimizer.of(settings)  # applied to the server rule's step (conclude)
        # tensors an algorithm sends beside the delta (FedSMOO's mu), averaged uniformly per round
        self.extra_specs = self.server_rule.extra_specs(self.specs)
        # downlink = "delta": B, the model devices reconstruct from lossy deltas (evaluated and served);
        # self.weights stays the global model G of the server rule; G - B is what the downlink still owes
        self.broadcast = delta_downlink.Broadcast(self.release_tensors(), 0, settings.downlink_codec,
                                                  settings.downlink_chain) if settings.downlink == "delta" else None
        self.rng = random.Random(seed)
        self.attempts: dict[int, int] = {}  # round -> last attempt number used (continues across restarts)
        self.stopping = threading.Event()
        self.presence_settled = False
        self._resumed = False  # the state came from a checkpoint

        # the fold's state across rounds
        self.verdicts = Verdicts()  # what the fold made of each accepted update (engine/verdicts.py)
        self.sample_weights = SampleWeights(settings.weighting, settings.weight_cap)
        self.norm_bound = NormBound(settings.norm_bound)
        # centered_clip: the last applied aggregate step is the next round's centre (known before the
        # round opens, to the sites too), and the radius' history of distances from it
        self.center: dict[str, np.ndarray] | None = None
        self.radius = NormBound.radius(settings.norm_bound)
        self.consensus = Consensus(settings.kinship, settings.agreement_floor,  # standing by agreement
                                   settings.agreement_flags)
        keys = dict(device_keys or {})
        self.privacy = private_rounds_for(settings, len(keys))

        # the parts the loop holds, and its two choices
        closed_at: dict[int, float] = {}  # round -> when it closed (the intake's and the schedule's)
        self.schedule: SyncRounds | BufferedVersions = (
            BufferedVersions(settings.staleness_weight, settings.max_staleness, settings.round_timeout,
                             lambda: self.version, private=self.privacy is not None)
            if settings.mode == "buffered" else SyncRounds(closed_at))
        self.releases = ModelReleases(self.fed, arch, fingerprint(self.model), settings.model_codec,
                                      settings.model_chunk_bytes, settings.downlink_chain,
                                      keep_older=self.schedule.keeps_older_releases)
        terms = Terms(settings, objective, self.server_rule, self.algorithm.name, self.specs, self.extra_specs,
                      self.sample_weights)
        self.journal = VerdictJournal(store.dir) if store else None
        self.intake = UpdateIntake(self.fed, terms, keys, DevicePresence(store, self.metrics,
                                                                         serves=protocol.serves(min_protocol)),
                                   self.schedule.freshness, self.verdicts, self.metrics, store,
                                   lambda topic, payload: self.transport.publish(topic, payload),
                                   self.releases.sha, closed_at, self.journal)
        self.topology: Devices | Sites = (Sites(sites, terms.max_update_bytes) if sites is not None
                                          else Devices(self.intake.presence))
        self.presence = self.topology.presence
        self.records = RoundRecords(self.metrics, self.verdicts, self.consensus, objective, self.privacy)
        # [serving]: the model it vouches for, published for the devices to serve (`run` only)
        self.serving = ServingReleases(self.fed, arch, fingerprint(self.model), settings.model_codec,
                                       settings.model_chunk_bytes, serving, objective.higher_is_better,
                                       store.dir if store else None) if serving is not None else None
        if store:
            self._resume(store)

    def _resume(self, store: Store) -> None:
        ckpt = store.recover_checkpoint()
        if ckpt is None:
            return
        if ckpt.arch != self.arch:
            raise ValueError(f"checkpoint in {store.dir} is for model {ckpt.arch!r}, not {self.arch!r}; "
                             "use another state directory")
        self.weights, self.version, self.next_round = ckpt.weights, ckpt.version, ckpt.round + 1
        self._resumed = True
        set_weights(self.model, self.weights)
        self.server_rule.load_state(ckpt.server_state)
        self.server_optimizer.load_state(ckpt.server_optimizer, self.specs)
        self.sample_weights.load_state(ckpt.trust.get("weights") or {})
        self.norm_bound.load_state(ckpt.trust.get("norms") or {})
        self.radius.load_state(ckpt.trust.get("radius") or {})
        self.consensus.load_state(ckpt.trust.get("consensus") or {})
        self.topology.load_trust(ckpt.trust)
        center = ckpt.trust.get("center")
        self.center = {n: np.asarray(center[n], dtype=np.float32) for n in self.specs} if center else None
        self.rng.seed(f"{ckpt.sha256}/{ckpt.round}")
        if self.privacy:
            self.privacy.load_state(ckpt.trust.get("privacy") or {})
        if self.broadcast is not None and not self.broadcast.load(ckpt.downlink, self.version):
            # no broadcast state for this version (an older checkpoint, a rollback): B starts as G,
            # and every device fetches the full model once
            self.broadcast = delta_downlink.Broadcast(self.release_tensors(), self.version,
                                                      self.settings.downlink_codec, self.settings.downlink_chain)
        self.served.weights = ckpt.served if ckpt.served is not None else dict(self.served_from())
        log.info("resumed from the checkpoint of round %d (model version %d, sha256 %s)",
                    ckpt.round, ckpt.version, ckpt.sha256[:12])

    # transport ----------------------------------------------------------------------
    def connect(self, host: str, port: int, username: str = COORDINATOR_USER, password: str = "",
                keepalive: int = 60, timeout: float = 30.0) -> None:
        # A persistent session (an hour): while we reconnect, the broker queues the devices' updates
        # for us instead of dropping them. The broker ties client ids to user names
        # (use_username_as_clientid), so no device can take this session over.
        transport = MqttTransport(f"{username}-{self.fed}", username, password, host, port,
                                  on_connect=self._on_connect, keepalive=keepalive, session_expiry=3600,
                                  max_queued=0)
        self.transport = transport
        transport.start(timeout)
        self.version = self.releases.skip_released_versions(transport.session, self.version, self._resumed)
        self.take_back_unsaved()

    def take_back_unsaved(self) -> None:
        """Verdicts the last run gave for a round it never saved: taken back (`intake.take_back_unsaved`)."""
        self.intake.take_back_unsaved(self.next_round)

    def _on_connect(self, client) -> None:  # noqa: ANN001 (paho client, on paho's thread)
        # Presence is re-learnt from the retained statuses the subscription delivers.
        self.transport.inbox.put(("", b"reset-presence", time.time(), False))
        client.subscribe(self.topology.subscriptions(self.fed))
        for topic, payload in self.releases.payloads + (self.serving.payloads if self.serving else []):
            client.publish(topic, payload, qos=1, retain=True)  # a restarted broker has lost the retained models

    def close(self) -> None:
        if isinstance(self.transport, MqttTransport):
            self.transport.stop()
        if self.journal is not None:
            self.journal.close()
        if self.store:
            self.store.close()

    def drain(self, timeout: float, current: Round | None = None) -> None:
        """Handle one queued message (or wait up to `timeout` for one)."""
        try:
            topic, payload, arrived, retained = self.transport.inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            self.presence.flush(quiet=True)
            return
        self.presence.flush(quiet=False)
        if topic == "" and payload == b"reset-presence":
            self.presence.online.clear()
            return
        self.topology.handle(self, topic, payload, arrived, retained, current)

    def idle(self, seconds: float) -> None:
        """Read the inbox for `seconds` (presence, late answers and their receipts) without a round open."""
        if self.serving is not None:
            self.serving.promote_if_asked(self.transport, self.objective.metric)
        until = time.monotonic() + seconds
        while not self.stopping.is_set() and (left := until - time.monotonic()) > 0:
            self.drain(min(left, 0.5))

    # presence -----------------------------------------------------------------------
    def presence_samples(self) -> int:
        """Training samples the online devices hold (in sites, as each site's leader adds them up)."""
        return self.presence.samples()

    def settle_presence(self, quiet: float = 0.5, limit: float = 5.0) -> None:
        """After (re)connecting, read the retained statuses until they stop arriving, so the first
        cohort is chosen from every device that is online, not from the first few to be heard."""
        if self.presence_settled:
            return
        give_up, last = time.monotonic() + limit, len(self.presence.online)
        quiet_since = time.monotonic()
        while time.monotonic() < give_up and time.monotonic() - quiet_since < quiet:
            self.drain(0.1)
            if len(self.presence.online) != last:
                last, quiet_since = len(self.presence.online), time.monotonic()
        self.presence_settled = True

    def wait_for_devices(self, count: int, timeout: float, progress: Callable[[int, int], None] | None = None) -> None:
        give_up = time.monotonic() + timeout
        last_seen = -1
        where = " at the sites" if isinstance(self.topology, Sites) else ""
        while self.presence.eligible_devices() < count:
            if self.stopping.is_set():
                raise RoundFailed("shutting down")
            if time.monotonic() > give_up:
                raise TimeoutError(f"only {self.presence.eligible_devices()} of {count} devices were online and "
                                   f"idle{where} within {timeout:.0f} s")
            if progress and self.presence.population() != last_seen:
                last_seen = self.presence.population()
                progress(last_seen, count)
            self.drain(0.2)
        if progress:
            progress(self.presence.population(), count)

    # versions -----------------------------------------------------------------------
    def run_round(self, round_no: int | None = None) -> RoundRecord:
        """Build the next model version (a sync round, or a buffer of K updates) and apply it."""
        return self.schedule.run_round(self, round_no or self.next_round)

    def set_state(self, rnd: Round, state: RoundState, reason: str = "") -> None:
        rnd.move(state, reason)
        log.debug("round %d (attempt %d): %s%s", rnd.number, rnd.attempt, state.value, f" ({reason})" if reason else "")
        if self.on_state:
            self.on_state(rnd)

    def open_round(self, round_no: int, attempt: int, cohort: set[str], deadline: float, population: int,
                   fold: FoldFactory | None = None) -> Round:
        """A fresh round: the server rule, the trust bounds and an empty fold (`fold`, or the fold of
        device updates with the mean of their extra tensors)."""
        self.server_rule.start_round(round_no, population)
        self.sample_weights.start_round()
        aggregate, extras = fold() if fold else (
            self.update_fold(round_no), StreamingMean(self.extra_specs) if self.extra_specs else None)
        return Round(round_no, attempt, cohort, deadline, self.version, aggregate, extras=extras)

    def update_fold(self, round_no: int) -> Fold:
        """The fold of one round's device updates: robust, or private under [privacy]."""
        s = self.settings
        if self.privacy:
            return self.privacy.fold(self.specs)
        root = self._root_update(round_no)
        return RobustRound(self.specs, self.norm_bound, s.aggregator, s.trim, s.normalize_steps,
                           root if s.reference != "median" else None, self.center, self.radius, self.consensus,
                           s.sign_quorum, s.verdict_banks, trust=root if s.root_trust else None)

    def _root_update(self, round_no: int) -> Callable[[list[str]], np.ndarray] | None:
        """The update of the coordinator's own training on root_data from this round's model (None: no
        root data), computed when the fold first asks for it."""
        if self.root is None:
            return None
        return lambda names: flattened(self.root_step(round_no), names)

    def root_step(self, round_no: int) -> dict[str, np.ndarray]:
        assert self.root is not None
        lr = float(self.settings.task_hparams(round_no)["lr"])
        return self.root.of(self.version, self.weights, lr, seed=round_no)

    def task(self, round_no: int, attempt: int, deadline: float, evaluate: bool, train: bool = True) -> messages.Task:
        s = self.settings
        return messages.Task(round_no, self.version, deadline, s.algorithm, s.task_hparams(round_no),
                             self.server_rule.broadcast(), s.codec, attempt, self.objective.task,
                             self.objective.loss, evaluate=evaluate, train=train)

    def publish_model(self, deadline: float) -> None:
        """The current version, retained (once per version; older ones as the schedule keeps them)."""
        self.releases.publish(self.transport, self.version, self.release_tensors(), self.broadcast, deadline)
        self.schedule.retire_releases(self)

    def served_from(self) -> dict[str, np.ndarray]:
        """The federation's model: B with a delta downlink (what every device holds), else G."""
        return self.weights if self.broadcast is None else {n: self.broadcast.tensors[n] for n in self.weights}

    def release_tensors(self) -> dict[str, np.ndarray]:
        return {**self.weights, **self.server_rule.broadcast_tensors()}  # e.g. FedSMOO's global perturbation

    def conclude(self, rnd: Round, base_sha: str) -> RoundRecord:
        """A closed round: the server rule's new global model, evaluation, checkpoint. An
        evaluation-only round keeps the model and records what the devices measured."""
        round_no = rnd.number
        self.intake.closed(round_no)
        if rnd.train:
            aggregate = rnd.aggregate.result()
            self.intake.flushed(rnd)  # the verdicts the close decided go out
            report = rnd.aggregate.report()
            if self.privacy:
                self.privacy.applied(report)
            self.center = aggregate
            # buffered mode: the damping and staleness of the step (a sync round: 1 and 0)
            self.server_rule.pace(report.damping, report.delay)
            proposed = self.server_rule.new_global(self.weights, aggregate,
                                                   rnd.extras.mean() if rnd.extras is not None else None)
            self.weights = self.server_optimizer.apply(self.weights, proposed, aggregate)
            self.version += 1
            if self.broadcast is not None:  # B follows G at once, so the checkpoint holds both
                self.broadcast.advance(self.release_tensors(), self.version)
            set_weights(self.model, self.weights)
            set_weights(self.served_model, self.served.update(self.served_from()))
        self.set_state(rnd, RoundState.AGGREGATED)
        central = (self.objective.evaluate(self.served_model, self.test_set)
                   if self.evaluate_central and self.test_set is not None else None)
        global_score = None
        if central is not None and self.broadcast is not None:  # G, which runs ahead of what devices hold
            ahead = copy.deepcopy(self.served_model)
            set_weights(ahead, self.weights)
            global_score = self.objective.evaluate(ahead, self.test_set).score
        self.set_state(rnd, RoundState.EVALUATED)
        closed = ("complete" if rnd.complete else "deadline") if rnd.train else "evaluated"
        record = self.record(rnd, base_sha, model_sha256(self.weights), closed, central)
        record.global_score = global_score
        if self.store:
            self.store.save_checkpoint(self.checkpoint(record))
            self.store.record_round(record_row(record))
        if self.journal is not None:
            self.journal.saved()  # the round's verdicts are in the database now
        self.set_state(rnd, RoundState.CHECKPOINTED)
        self.next_round = round_no + 1
        if self.serving is not None and rnd.train:
            score = central.score if central is not None else (record.federated or {}).get("score")
            served = self.served.weights if self.settings.serve_average else self.served_from()
            self.serving.after_round(self.transport, self.version, round_no, dict(served), dict(self.served_from()),
                                     score, self.objective.metric)
        self.records.published(record, central, self.evaluate_devices)
        return record

    # what a round leaves behind -------------------------------------------------------
    def record(self, rnd: Round, base_sha: str, model_sha: str, closed: str,
               central: Evaluation | None = None) -> RoundRecord:
        record = self.records.record(rnd, base_sha, model_sha, closed, central)
        self.topology.amend(record, rnd)
        return record

    def checkpoint(self, record: RoundRecord) -> Checkpoint:
        """The model, the server rule's and the trust bounds' state and the record of the round just
        closed: what a restarted engine resumes from."""
        return Checkpoint(record.round, self.version, self.arch, self.weights, record.model_sha256,
                          self.server_rule.state(), record_row(record),
                          self.served.weights if self.settings.serve_average else None,
                          self.trust_state(),
                          self.broadcast.state() if self.broadcast else {},
                          server_optimizer=self.server_optimizer.state())

    def trust_state(self) -> dict:
        """What the fold has learnt about its devices (bounds, standing, the centre, the privacy
        ledger): checkpointed so that a restart judges the next update as the last run would have."""
        return {"weights": self.sample_weights.state(), "norms": self.norm_bound.state(),
                "radius": self.radius.state(), "consensus": self.consensus.state(), "center": self.center,
                **({"privacy": self.privacy.state()} if self.privacy else {}), **self.topology.trust_state()}


def record_dict(record: RoundRecord) -> dict[str, Any]:
    return record_row(record)
