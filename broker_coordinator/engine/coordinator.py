"""The coordinator: rounds over MQTT, driven by the state machine in `rounds`.

paho's network thread only queues raw messages; every decision happens on the
thread that calls `run_round`, so nothing here needs a lock. Each round is
checkpointed (model, server state, round record) before the database learns of
it, so a coordinator killed at any point resumes without aggregating a round
twice (see `store`).

Every update is hostile until validated (`intake`: signature before parsing,
then schema, freshness, shapes, values; a rejection is logged, counted and
never touches the global model). Every answer gets a receipt on the device's
`receipt` topic (the agent resends until it has one), so nothing a device sent
in time is lost without a reason on one side.

A valid update is still a claim: its weight and its length are bounded by
what the server has seen (`trust`), and the round folds it robustly (`robust`).

Model releases (versions, the retained manifests, the delta downlink) are `releases`.
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
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.aggregation.consensus import Consensus
from broker_coordinator.aggregation.reference import root_direction
from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.aggregation.server_optimizer import ServerOptimizer
from broker_coordinator.aggregation.serving import ServedAverage
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import NormBound, SampleWeights
from broker_coordinator.engine.intake import UpdateIntake
from broker_coordinator.engine.presence import DevicePresence
from broker_coordinator.engine.private_rounds import PrivateRounds, uplink_advice
from broker_coordinator.engine.records import RoundRecords, record_row
from broker_coordinator.engine.releases import ModelReleases
from broker_coordinator.engine.rounds import Round, RoundFailed, RoundState  # noqa: F401 (RoundFailed is imported from here)
from broker_coordinator.engine.selection import select
from broker_coordinator.engine.verdicts import REPLAY_ROUNDS, Verdicts
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.settings import limits
from broker_coordinator.settings.round_settings import RoundRecord, RoundSettings  # noqa: F401 (RoundSettings is imported from here)
from broker_coordinator.storage.store import Store, model_sha256
from edgefl_protocol import (
    algorithms,
    codec,
    delta_downlink,
    messages,
    topics,
)
from edgefl_protocol.transport import Session
from models.architectures import build_model, fingerprint, get_weights, set_weights
from models.datasets import Dataset
from models.objectives import Objective

log = logging.getLogger("broker_coordinator")


class Coordinator(UpdateIntake, DevicePresence, ModelReleases, RoundRecords):
    def __init__(self, federation: str, arch: str, test_set: Dataset | None, settings: RoundSettings, seed: int = 0,
                 store: Store | None = None, metrics: Metrics | None = None,
                 on_state: Callable[[Round], None] | None = None,
                 device_keys: Mapping[str, bytes] | None = None, root_set: Dataset | None = None,
                 objective: Objective = Objective()) -> None:
        settings.validate()
        self.objective = objective
        self.evaluate_central, self.evaluate_devices = settings.evaluation(test_set is not None and len(test_set) > 0)
        if settings.reference == "root" and (root_set is None or len(root_set) == 0):
            raise ValueError("reference = \"root\" needs a small labelled dataset on the coordinator: set "
                             "[federation] root_data (not the test set)")
        if root_set is not None and objective.task != "classification":
            raise ValueError("root_data (the trusted reference) is for classification tasks; unset it for "
                             f"a {objective.task} task")
        self.root_set = root_set
        self.fed = topics.check_name("federation", federation)
        self.arch, self.settings, self.test_set = arch, settings, test_set
        self.store, self.metrics, self.on_state = store, metrics or Metrics(), on_state
        self.model = build_model(arch, seed)
        self.fingerprint = fingerprint(self.model)  # devices refuse a release whose model differs from theirs
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
        self.server_optimizer = ServerOptimizer.of(settings)  # applied to the server rule's step (_conclude)
        # tensors an algorithm sends beside the delta (FedSMOO's mu), averaged uniformly per round
        self.extra_specs = self.server_rule.extra_specs(self.specs)
        self.extras: StreamingMean | None = None
        self.max_values = sum(math.prod(shape) for shape in {**self.specs, **self.extra_specs}.values())
        self.max_update_bytes = limits.update_cap(self.specs, self.extra_specs)  # the broker's packet limit agrees
        # downlink = "delta": B, the model devices reconstruct from lossy deltas (evaluated and served);
        # self.weights stays the global model G of the server rule; G - B is what the downlink still owes
        self.broadcast = delta_downlink.Broadcast(self._release_tensors(), 0, settings.downlink_codec,
                                                  settings.downlink_chain) if settings.downlink == "delta" else None
        self._retained_deltas: set[str] = set()  # delta topics retained on the broker
        self.rng = random.Random(seed)
        self.online: dict[str, dict[str, Any]] = {}
        self.pending_until: dict[str, float] = {}  # tasked devices that have not answered yet
        self.pending_round: dict[str, int] = {}
        self.last_metrics: dict[str, dict[str, Any]] = {}
        self.closed_at: dict[int, float] = {}
        self.rejections: Counter[str] = Counter()
        self.device_keys: dict[str, bytes] = dict(device_keys or {})  # device -> HMAC key (from enrollment)
        # (device, round, attempt) -> sha256 of the accepted payload: replay guard, and resends are recognised
        self.accepted: dict[tuple[str, int, int], str] = {}
        self.verdicts = Verdicts()  # what the fold made of each accepted update (engine/verdicts.py)
        self.sample_weights = SampleWeights(settings.weighting, settings.weight_cap)
        self.norm_bound = NormBound(settings.norm_bound)
        # centered_clip: the last applied aggregate step is the next round's centre (known before the
        # round opens, to the sites too), and the radius' history of distances from it
        self.center: dict[str, np.ndarray] | None = None
        self.radius = NormBound(settings.norm_bound or 1.5)
        # centered_clip: devices' standing by agreement with their rounds
        self.consensus = Consensus(settings.kinship, settings.agreement_floor)
        self.attempts: dict[int, int] = {}  # round -> last attempt number used (continues across restarts)
        self._admitted: tuple[float, set[str] | None] = (0.0, None)  # (when, devices the registry admits)
        self._presence_settled = False
        self._said_unscored = False  # warned that devices asked to evaluate reported no score (once a process)
        # device -> None (admitted) or (reason, detail); e.g. Registry.admission, which rejects
        # unknown and revoked devices. None: every device the broker lets in is admitted (simulate).
        self.admission: Callable[[str], tuple[str, str] | None] | None = None
        self.inbox: queue.Queue[tuple[str, bytes, float, bool]] = queue.Queue()  # topic, payload, arrival, retained
        self.stopping = threading.Event()
        self.session: Session | None = None
        self._model_payloads: list[tuple[str, bytes]] = []  # retained (topic, payload) of the current model
        self._published: tuple[int, int] | None = None  # (version, chunks) of the retained model
        self._resumed = False  # the state came from a checkpoint
        self._resumed_trust: dict = {}
        # version -> sha256 of its release: intake rejects an update whose reported base is another model
        self.released_sha: dict[int, str] = {}
        # [privacy] mode = "central": the private fold replaces the robust one (engine/private_rounds.py)
        self.privacy = PrivateRounds(settings.privacy, settings.privacy.population or len(self.device_keys),
                                     settings.clients_per_round,
                                     settings.buffer_size if settings.mode == "buffered" else 0) \
            if settings.privacy.on else None
        if self.privacy is not None and (advice := uplink_advice(settings.codec)):
            log.warning(advice)
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
        self._resumed_trust = dict(ckpt.trust)  # for subclasses' own parts of it (the tree's site standing)
        set_weights(self.model, self.weights)
        self.server_rule.load_state(ckpt.server_state)
        self.server_optimizer.load_state(ckpt.server_optimizer, self.specs)
        self.sample_weights.load_state(ckpt.trust.get("weights") or {})
        self.norm_bound.load_state(ckpt.trust.get("norms") or {})
        self.radius.load_state(ckpt.trust.get("radius") or {})
        self.consensus.load_state(ckpt.trust.get("consensus") or {})
        center = ckpt.trust.get("center")
        self.center = {n: np.asarray(center[n], dtype=np.float32) for n in self.specs} if center else None
        self.rng.seed(f"{ckpt.sha256}/{ckpt.round}")
        if self.privacy:
            self.privacy.load_state(ckpt.trust.get("privacy") or {})
        if self.broadcast is not None and not self.broadcast.load(ckpt.downlink, self.version):
            # no broadcast state for this version (an older checkpoint, a rollback): B starts as G,
            # and every device fetches the full model once
            self.broadcast = delta_downlink.Broadcast(self._release_tensors(), self.version,
                                                      self.settings.downlink_codec, self.settings.downlink_chain)
        self.served.weights = ckpt.served if ckpt.served is not None else dict(self._served_from())
        log.warning("resumed from the checkpoint of round %d (model version %d, sha256 %s)",
                    ckpt.round, ckpt.version, ckpt.sha256[:12])

    # session ------------------------------------------------------------------------
    def connect(self, host: str, port: int, username: str = COORDINATOR_USER, password: str = "",
                keepalive: int = 60, timeout: float = 30.0) -> None:
        # A persistent session (an hour): while we reconnect, the broker queues the devices' updates
        # for us instead of dropping them. The broker ties client ids to user names
        # (use_username_as_clientid), so no device can take this session over.
        self.session = Session(f"{username}-{self.fed}", username, password, host, port,
                               on_connect=self._on_connect,
                               on_message=lambda c, msg: self.inbox.put((msg.topic, msg.payload, time.time(),
                                                                         bool(msg.retain))),
                               keepalive=keepalive, session_expiry=3600, max_queued=0)
        self.session.start(timeout)
        self._skip_released_versions()

    def _on_connect(self, client) -> None:  # noqa: ANN001 (paho client, on paho's thread)
        # Presence is re-learnt from the retained statuses the subscription delivers.
        self.inbox.put(("", b"reset-presence", time.time(), False))
        client.subscribe([(topics.all_updates(self.fed), 1), (topics.all_statuses(self.fed), 1)])
        for topic, payload in self._model_payloads:  # a restarted broker has lost the retained model
            client.publish(topic, payload, qos=1, retain=True)

    def close(self) -> None:
        if self.session:
            self.session.stop()
        if self.store:
            self.store.close()

    # inbox --------------------------------------------------------------------------
    def _drain(self, timeout: float, current: Round | None = None) -> None:
        """Handle one queued message (or wait up to `timeout` for one)."""
        try:
            topic, payload, arrived, retained = self.inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            self._flush_presence(quiet=True)
            return
        self._flush_presence(quiet=False)
        if topic == "" and payload == b"reset-presence":
            self.online.clear()
            return
        parsed = topics.parse_device_topic(topic)
        if parsed is None or parsed[0] != self.fed:
            return
        _, device, kind = parsed
        if kind == "status":
            self._on_status(device, payload)
        elif kind == "update" and retained:
            if payload:  # a device left a retained message on its update topic: it would replay on every
                # reconnect of ours, so it is never an answer; clear it
                self._reject(device, "retained", "updates must not be retained; cleared it", None)
                assert self.session is not None
                self.session.publish(topic, b"", qos=1, retain=True)
        elif kind == "update" and payload:  # an empty payload is our own clearing of a retained one
            self._on_update(current, device, payload, arrived)

    # rounds -------------------------------------------------------------------------
    def _set_state(self, rnd: Round, state: RoundState, reason: str = "") -> None:
        rnd.move(state, reason)
        log.info("round %d (attempt %d): %s%s", rnd.number, rnd.attempt, state.value, f" ({reason})" if reason else "")
        if self.on_state:
            self.on_state(rnd)

    def _attempt(self, round_no: int, attempt: int) -> Round:
        s = self.settings
        if not self._presence_settled:
            self._settle_presence()
        deadline = time.time() + s.round_timeout
        # wait (within this attempt's deadline) until a quorum of devices is eligible
        while len(self.eligible()) < s.min_updates and time.time() < deadline and not self.stopping.is_set():
            self._drain(min(0.5, deadline - time.time()))
        eligible = self.eligible()
        k = len(eligible) if s.clients_per_round == 0 else s.clients_per_round
        cohort = (self.privacy.cohort(eligible) if self.privacy
                  else set(select(s.selection, eligible, k, self.rng, self.last_metrics)))
        rnd = self._open_round(round_no, attempt, cohort, deadline, len(self.online))
        rnd.train = not s.evaluation_only(round_no)
        if self.on_state:
            self.on_state(rnd)
        if len(cohort) < s.min_updates:
            self._set_state(rnd, RoundState.ABANDONED,
                            f"only {len(cohort)} device(s) online and idle, quorum is {s.min_updates}")
            return rnd
        self._publish_model(deadline)
        task = messages.Task(round_no, self.version, deadline, s.algorithm, s.task_hparams(round_no),
                             self.server_rule.broadcast(), s.codec, attempt, self.objective.task,
                             self.objective.loss, evaluate=self.evaluate_devices or not rnd.train, train=rnd.train)
        payload = messages.encode("task", task)
        assert self.session is not None
        for device in cohort:
            # after the deadline the retained status says whether it is still training (busy)
            self.pending_until[device] = deadline
            self.pending_round[device] = round_no
        # every task is confirmed by the broker (PUBACK), retried across reconnects; one never sent is
        # a device that cannot answer, and the log says which
        unsent = self.session.publish_all([(topics.task(self.fed, d), payload) for d in sorted(cohort)],
                                          min(deadline, time.time() + 60))
        for topic in unsent:
            log.error("round %d: the task for %s could not be published", round_no, topic.split("/")[3])
        self._collect(rnd, deadline)
        count = rnd.counted
        if self.stopping.is_set():
            self._set_state(rnd, RoundState.ABANDONED, "coordinator shutting down")
        elif count >= s.min_updates:
            self._set_state(rnd, RoundState.CLOSED, "all selected devices answered" if rnd.complete
                            else f"deadline passed with {count} of {len(cohort)} answers")
        else:
            answers = "updates" if rnd.train else "evaluation reports"
            why = f"{count} of {len(cohort)} {answers} at the deadline, quorum is {s.min_updates}"
            if rnd.refused:
                reasons = Counter(rnd.refused.values()).most_common(2)
                why += f"; {len(rnd.refused)} refused the task ({'; '.join(r for r, _ in reasons)})"
            if unsent:
                why += f"; {len(unsent)} tasks could not be published"
            self._set_state(rnd, RoundState.ABANDONED, why)
        return rnd

    def _collect(self, rnd: Round, deadline: float) -> None:
        """Take answers as they arrive until every expected one is in, the deadline, or shutdown."""
        self._set_state(rnd, RoundState.COLLECTING)
        while not rnd.complete and time.time() < deadline and not self.stopping.is_set():
            self._drain(min(0.5, deadline - time.time()), rnd)

    def run_round(self, round_no: int | None = None) -> RoundRecord:
        """Run the next round to its end, retrying with a new cohort while there is no quorum."""
        round_no = round_no or self.next_round
        base_sha = model_sha256(self.weights)
        # attempt numbers never repeat for a round, across restarts too: an answer names its attempt
        attempt = max(self.attempts.get(round_no, 0), self.store.last_attempt(round_no) if self.store else 0)
        if self.privacy:
            self.privacy.check_budget(round_no)  # raises BudgetSpent: the round is not opened
        while True:
            attempt += 1
            self.attempts[round_no] = attempt
            if self.store:
                self.store.start_attempt(round_no, attempt)
            rnd = self._attempt(round_no, attempt)
            if rnd.state == RoundState.CLOSED:
                break
            self.metrics.rounds.labels("abandoned").inc()
            log.warning("round %d attempt %d abandoned: %s; the global model is unchanged",
                        round_no, attempt, rnd.reason)
            self._abandoned(rnd)
            if self.store:
                self.store.record_round(record_row(self._record(rnd, base_sha, base_sha, "abandoned")))
            if self.stopping.is_set():
                raise RoundFailed(f"round {round_no} abandoned: {rnd.reason}")
            if self.settings.max_attempts and attempt >= self.settings.max_attempts:
                raise RoundFailed(f"round {round_no} found no quorum in {attempt} attempts: {rnd.reason}")
        return self._conclude(rnd, base_sha)

    def _open_round(self, round_no: int, attempt: int, cohort: set[str], deadline: float, population: int) -> Round:
        """A fresh round: the server rule, the trust bounds and an empty robust aggregate."""
        s = self.settings
        self.server_rule.start_round(round_no, population)
        self.extras = StreamingMean(self.extra_specs) if self.extra_specs else None
        self.sample_weights.start_round()
        return Round(round_no, attempt, cohort, deadline, self.version, self.privacy.fold(self.specs) if self.privacy
                     else RobustRound(self.specs, self.norm_bound, s.aggregator, s.trim, s.normalize_steps,
                                 self._reference(round_no), self.center, self.radius, self.consensus,
                                 s.sign_quorum, s.verdict_banks))

    def _reference(self, round_no: int) -> Callable[[list[str]], np.ndarray] | None:
        if self.settings.reference == "median" or self.root_set is None:
            return None
        base = dict(self.weights)  # the model this round's devices trained from
        lr = float(self.settings.task_hparams(round_no)["lr"])
        return lambda names: root_direction(self.arch, base, self.root_set, names, lr, seed=round_no)

    def _conclude(self, rnd: Round, base_sha: str) -> RoundRecord:
        """A closed round: the server rule's new global model, evaluation, checkpoint. An
        evaluation-only round keeps the model and records what the devices measured."""
        round_no = rnd.number
        self.closed_at[round_no] = time.time()
        # the replay guard needs only recent rounds: older answers are rejected as late anyway
        self.accepted = {key: digest for key, digest in self.accepted.items() if key[1] > round_no - REPLAY_ROUNDS}
        self.verdicts.forget(round_no - REPLAY_ROUNDS + 1)
        if rnd.train:
            aggregate = rnd.aggregate.result()
            self._flushed(rnd)  # the verdicts the close decided go out
            report = rnd.aggregate.report()
            if self.privacy:
                self.privacy.applied(report)
            self.center = aggregate
            # buffered mode: the damping and staleness of the step (a sync round: 1 and 0)
            self.server_rule.pace(report.damping, report.delay)
            proposed = self.server_rule.new_global(self.weights, aggregate,
                                                   self.extras.mean() if self.extras is not None else None)
            self.weights = self.server_optimizer.apply(self.weights, proposed, aggregate)
            self.version += 1
            if self.broadcast is not None:  # B follows G at once, so the checkpoint holds both
                self.broadcast.advance(self._release_tensors(), self.version)
            set_weights(self.model, self.weights)
            set_weights(self.served_model, self.served.update(self._served_from()))
        self._set_state(rnd, RoundState.AGGREGATED)
        central = (self.objective.evaluate(self.served_model, self.test_set)
                   if self.evaluate_central and self.test_set is not None else None)
        global_score = None
        if central is not None and self.broadcast is not None:  # G, which runs ahead of what devices hold
            ahead = copy.deepcopy(self.served_model)
            set_weights(ahead, self.weights)
            global_score = self.objective.evaluate(ahead, self.test_set).score
        self._set_state(rnd, RoundState.EVALUATED)
        closed = ("complete" if rnd.complete else "deadline") if rnd.train else "evaluated"
        record = self._record(rnd, base_sha, model_sha256(self.weights), closed, central)
        record.global_score = global_score
        if self.store:
            self.store.save_checkpoint(self._checkpoint(record))
            self.store.record_round(record_row(record))
        self._set_state(rnd, RoundState.CHECKPOINTED)
        self.next_round = round_no + 1
        self.metrics.rounds.labels(record.closed).inc()
        self.metrics.round_seconds.observe(record.seconds)
        if self.privacy:
            self.metrics.privacy_epsilon.set(self.privacy.spent)
        if central is not None:
            self.metrics.score.labels(central.metric, "central").set(central.score)
            self.metrics.loss.set(central.loss)
            if self.objective.task == "classification":
                self.metrics.accuracy.set(central.score)
        if record.federated:
            self.metrics.score.labels(record.federated["metric"], "devices").set(record.federated["score"])
        elif central is None and self.evaluate_devices and record.participants and not self._said_unscored:
            self._said_unscored = True  # every such round would say the same
            log.warning("round %d: the devices were asked to evaluate and none reported a score, so no "
                        "accuracy is measured; an agent evaluates on the data it holds out ([data] holdout = 0.2 "
                        "in its agent.toml: the [device] data shorthand that `edge-agent enroll` writes holds out "
                        "none), or give this coordinator a test set ([federation] test_data)", round_no)
        self.metrics.round.set(round_no)
        return record

def record_dict(record: RoundRecord) -> dict[str, Any]:
    return record_row(record)
