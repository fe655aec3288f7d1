"""The coordinator: rounds over MQTT, driven by the state machine in `rounds`.

paho's network thread only queues raw messages; every decision happens on the
thread that calls `run_round`, so nothing here needs a lock. Each round is
checkpointed (model, server state, round record) before the database learns of
it, so a coordinator killed at any point resumes without aggregating a round
twice (see `store`).

Every update is hostile until validated: size cap, then the device's HMAC
signature (before anything is parsed), then sender, federation, replay,
round, attempt and model-version freshness, deadline, cohort, codec, shapes,
finite values and the optional hard norm bound. A rejection is logged with its
reason, counted per reason and never touches the global model. Every answer
gets a receipt on the device's `receipt` topic (the agent resends until it has
one), so nothing a device sent in time is lost without a reason on one side.

A valid update is still a claim: its weight and its length are bounded by
what the server has seen (`trust`), and the round folds it robustly (`robust`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from edgefl_protocol import algorithms, codec, downlink, messages, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.task_limits import check_training
from edgefl_protocol.transport import Session
from models.architectures import build_model, get_weights, set_weights
from models.datasets import Dataset

from . import limits
from .reference import root_direction
from .aggregation import StreamingMean
from .broker import COORDINATOR_USER
from .robust import AGGREGATORS, RobustRound, l2_norm
from .trust import WEIGHTINGS, NormBound, SampleWeights
from .evaluation import evaluate
from .metrics import Metrics
from .rounds import Round, RoundState
from .selection import POLICIES, select
from .serving import ServedAverage
from .store import Checkpoint, Store, model_sha256

log = logging.getLogger("broker_coordinator")


@dataclass
class RoundSettings:
    algorithm: str = algorithms.DEFAULT_ALGORITHM
    clients_per_round: int = 0  # 0: every eligible device
    selection: str = "random"
    local_epochs: int = 0  # 0: each device chooses from its measured speed and the deadline (the field default)
    batch_size: int = 32
    lr: float = 0.05
    lr_decay: float = 0.998  # per round
    momentum: float = 0.0
    weight_decay: float = 1e-3
    grad_clip: float = 10.0
    round_timeout: float = 300.0  # seconds from task to deadline
    min_updates: int = 1  # quorum needed to close a round at its deadline
    max_attempts: int = 3  # tries per round without quorum before giving up; 0 = keep trying
    normalize_steps: bool = False  # FedNova-style normalization by local steps
    codec: str = codec.DEFAULT  # uplink codec the tasks name (see edgefl_protocol.codec)
    model_codec: str = "float32"  # downlink: float32 (lossless) or float16, optionally +zlib
    model_chunk_bytes: int = downlink.DEFAULT_CHUNK_BYTES
    max_update_norm: float = 0.0  # reject deltas whose L2 norm exceeds this; 0 = no hard bound
    # what a device's update may weigh and how far it may move the model (see broker_coordinator/trust.py)
    weighting: str = "capped"  # capped | uniform | reported (the device's own sample count)
    weight_cap: float = 2.0  # capped: at most this times the median trusted sample count
    norm_bound: float = 1.5  # clip deltas to this times the median norm of recent ones; 0 = off
    aggregator: str = "gated_mean"  # gated_mean | mean | trimmed_mean | median (see broker_coordinator/robust.py)
    trim: float = 0.2  # trimmed_mean: fraction dropped at each end, per coordinate
    reference: str = "auto"  # gated_mean's direction: "root" (needs root data), "median", or "auto" (root if given)
    serve_average: float = 0.0  # evaluate and keep an EMA of the global models with this decay; 0 = the last model
    hparams: dict[str, float] = field(default_factory=dict)  # algorithm-specific, over its defaults

    def validate(self) -> None:
        algorithm = algorithms.get(self.algorithm)
        unknown = sorted(set(self.hparams) - set(algorithm.defaults))
        if unknown:
            raise ValueError(f"{self.algorithm} has no hyper-parameter {', '.join(unknown)}; "
                             f"it takes {', '.join(sorted(algorithm.defaults)) or 'none'}")
        checks = [
            (self.clients_per_round >= 0, "clients_per_round must be >= 0 (0 = all eligible devices)"),
            (self.selection in POLICIES, f"selection must be one of {', '.join(POLICIES)}"),
            (self.local_epochs >= 0, "local_epochs must be >= 0 (0 = chosen by each device)"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.lr > 0, "lr must be > 0"),
            (0 < self.lr_decay <= 1, "lr_decay must be in (0, 1]"),
            (0 <= self.momentum < 1, "momentum must be in [0, 1)"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.round_timeout > 0, "round_timeout must be > 0"),
            (self.min_updates >= 1, "min_updates must be >= 1"),
            (self.max_attempts >= 0, "max_attempts must be >= 0 (0 = unlimited)"),
            (self.model_chunk_bytes >= 1024, "model_chunk_bytes must be >= 1024"),
            (self.max_update_norm >= 0, "max_update_norm must be >= 0 (0 = no bound)"),
            (self.weighting in WEIGHTINGS, f"weighting must be one of {', '.join(WEIGHTINGS)}"),
            (self.weight_cap >= 1, "weight_cap must be >= 1 (times the median trusted sample count)"),
            (self.norm_bound == 0 or self.norm_bound >= 1, "norm_bound must be 0 (off) or >= 1 (times the median "
                                                           "norm of recent updates)"),
            (self.aggregator in AGGREGATORS, f"aggregator must be one of {', '.join(AGGREGATORS)}"),
            (0 <= self.trim < 0.5, "trim must be in [0, 0.5)"),
            (self.reference in ("auto", "median", "root"), "reference must be auto, median or root"),
            (0 <= self.serve_average < 1, "serve_average must be in [0, 1) (the decay of the served moving "
                                          "average of global models; 0 = serve the last global model)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        try:  # the ranges every agent enforces: a task they would all refuse is a config error here
            check_training(self.task_hparams(1))
        except Rejected as exc:
            raise ValueError(f"{exc.detail} (agents refuse tasks outside edgefl_protocol.task_limits)") from None
        codec.parse(self.codec)
        downlink.check_model_codec(self.model_codec)

    def task_hparams(self, round_no: int) -> dict[str, float]:
        algorithm = algorithms.get(self.algorithm)
        return {
            **algorithm.defaults, **self.hparams,
            "local_epochs": self.local_epochs, "batch_size": self.batch_size,
            "lr": self.lr * self.lr_decay ** (round_no - 1), "momentum": self.momentum,
            "weight_decay": self.weight_decay, "grad_clip": self.grad_clip,
        }


@dataclass
class RoundRecord:
    round: int
    attempt: int
    participants: int
    selected: int
    accuracy: float
    loss: float
    bytes_up: int
    seconds: float
    rejected: dict[str, int]
    closed: str  # "complete" | "deadline" | "abandoned"
    base_sha256: str
    model_sha256: str
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)  # {"norm": n, "weight": m}: bounded, not rejected
    refused: dict[str, str] = field(default_factory=dict)  # device -> why it refused the task
    reason: str = ""


class RoundFailed(Exception):
    """A round found no quorum in any of its attempts."""


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


class Coordinator:
    def __init__(self, federation: str, arch: str, test_set: Dataset, settings: RoundSettings, seed: int = 0,
                 store: Store | None = None, metrics: Metrics | None = None,
                 on_state: Callable[[Round], None] | None = None,
                 device_keys: Mapping[str, bytes] | None = None, root_set: Dataset | None = None) -> None:
        settings.validate()
        if settings.reference == "root" and (root_set is None or len(root_set) == 0):
            raise ValueError("reference = \"root\" needs a small labelled dataset on the coordinator: set "
                             "[federation] root_data (not the test set)")
        self.root_set = root_set
        self.fed = topics.check_name("federation", federation)
        self.arch, self.settings, self.test_set = arch, settings, test_set
        self.store, self.metrics, self.on_state = store, metrics or Metrics(), on_state
        self.model = build_model(arch, seed)
        self.weights = get_weights(self.model)
        self.specs = codec.specs_of(self.weights)
        self.served = ServedAverage(self.weights, settings.serve_average)  # what is evaluated and kept
        self.served_model = build_model(arch)
        self.version = 0
        self.next_round = 1
        self.algorithm = algorithms.get(settings.algorithm)
        self.server_rule = self.algorithm.server(settings.task_hparams(1))
        # tensors an algorithm sends beside the delta (FedSMOO's mu), averaged uniformly per round
        self.extra_specs = self.server_rule.extra_specs(self.specs)
        self.extras: StreamingMean | None = None
        self.max_values = sum(math.prod(shape) for shape in {**self.specs, **self.extra_specs}.values())
        self.max_update_bytes = limits.update_cap(self.specs, self.extra_specs)  # the broker's packet limit agrees
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
        self.sample_weights = SampleWeights(settings.weighting, settings.weight_cap)
        self.norm_bound = NormBound(settings.norm_bound)
        self.attempts: dict[int, int] = {}  # round -> last attempt number used (continues across restarts)
        self._admitted: tuple[float, set[str] | None] = (0.0, None)  # (when, devices the registry admits)
        self._presence_settled = False
        # device -> None (admitted) or (reason, detail); e.g. Registry.admission, which rejects
        # unknown and revoked devices. None: every device the broker lets in is admitted (simulate).
        self.admission: Callable[[str], tuple[str, str] | None] | None = None
        self.inbox: queue.Queue[tuple[str, bytes, float, bool]] = queue.Queue()  # topic, payload, arrival, retained
        self.stopping = threading.Event()
        self.session: Session | None = None
        self._model_payloads: list[tuple[str, bytes]] = []  # retained (topic, payload) of the current model
        self._published: tuple[int, int] | None = None  # (version, chunks) of the retained model
        if store:
            self._resume(store)

    def _resume(self, store: Store) -> None:
        ckpt = store.load_checkpoint()
        if ckpt is None:
            return
        if ckpt.arch != self.arch:
            raise ValueError(f"checkpoint in {store.dir} is for model {ckpt.arch!r}, not {self.arch!r}; "
                             "use another state directory")
        self.weights, self.version, self.next_round = ckpt.weights, ckpt.version, ckpt.round + 1
        set_weights(self.model, self.weights)
        self.server_rule.load_state(ckpt.server_state)
        self.sample_weights.load_state(ckpt.trust.get("weights") or {})
        self.norm_bound.load_state(ckpt.trust.get("norms") or {})
        self.served.weights = ckpt.served if ckpt.served is not None else dict(self.weights)
        self.rng.seed(f"{ckpt.sha256}/{ckpt.round}")
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
            return
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

    def _on_status(self, device: str, payload: bytes) -> None:
        if not payload:
            self.online.pop(device, None)
            return
        try:
            status = messages.decode_status(payload)
        except Rejected as exc:
            log.warning("status from %s ignored: %s", device, exc)
            return
        if status.state == "online":
            self.online[device] = dict(status.profile)
            last_round = status.profile.get("last_round", 0)
            if (not status.profile.get("busy") and isinstance(last_round, int)
                    and last_round >= self.pending_round.get(device, 0)):
                # idle and done with the round it was tasked for (even if its answer was lost): free again
                self.pending_until.pop(device, None)
        else:
            self.online.pop(device, None)
            self.pending_until.pop(device, None)
        if self.store:
            self.store.record_presence(device, status.state == "online", dict(status.profile))
        self.metrics.online.set(len(self.online))

    def _reject(self, device: str, reason: str, detail: str, current: Round | None = None) -> None:
        self.rejections[reason] += 1
        self.metrics.rejected.labels(reason).inc()
        if current is not None:
            current.rejected[reason] += 1
        log.warning("update from %s rejected: %s: %s", device, reason, detail)

    def _on_update(self, current: Round | None, device: str, data: bytes, arrived: float) -> None:
        self.pending_until.pop(device, None)  # whatever its fate, the device is no longer busy with it
        digest = hashlib.sha256(data).hexdigest()
        try:
            answer = self._validate(current, device, data, arrived, digest)
        except Rejected as exc:
            self._reject(device, exc.reason, exc.detail, current)
            if self.store and current is not None:
                self.store.record_device_round(current.number, current.attempt, device, False, exc.reason, None)
            self._receipt(device, None, exc)
            return
        if answer is None:  # the same accepted update again: the device did not get our receipt
            return
        assert current is not None
        if isinstance(answer, messages.Refusal):
            current.refused[device] = f"{answer.reason}: {answer.detail}"
            log.warning("%s refused round %d (attempt %d): %s: %s", device, current.number, current.attempt,
                        answer.reason, answer.detail)
            if self.store:
                self.store.record_device_round(current.number, current.attempt, device, False,
                                               f"refused:{answer.reason}", {"detail": answer.detail})
            self._receipt(device, current, None)
            return
        update, delta, weight, steps, weight_note = answer
        if weight_note:
            current.weights_clipped += 1
        current.aggregate.add(device, {name: delta[name] for name in self.specs}, weight, steps)
        if self.extras is not None:
            self.extras.add({name: delta[name] for name in self.extra_specs}, 1.0)
        self.server_rule.observe(device, update.num_samples, update.metrics)
        current.answered.add(device)
        self.accepted[(device, current.number, current.attempt)] = digest
        current.device_metrics[device] = dict(update.metrics, num_samples=update.num_samples, weight=weight)
        current.bytes_up += len(data)
        self.last_metrics[device] = dict(update.metrics)
        self.metrics.accepted.inc()
        self.metrics.bytes_up.inc(len(data))
        if self.store:
            self.store.record_device_round(current.number, current.attempt, device, True, None,
                                           current.device_metrics[device])
        self._receipt(device, current, None)

    def _receipt(self, device: str, current: Round | None, rejected: Rejected | None,
                 answer: tuple[int, int] | None = None) -> None:
        """Tell the device what became of its answer, so that it stops resending (or says why in its log)."""
        if self.session is None:
            return
        round_no, attempt = answer or ((current.number, current.attempt) if current else (0, 1))
        if rejected is not None:
            round_no, attempt = getattr(rejected, "answer", None) or (round_no, attempt)
        receipt = messages.Receipt(round_no, attempt, rejected is None, rejected.reason if rejected else "",
                                   rejected.detail[:1000] if rejected else "")
        self.session.publish(topics.receipt(self.fed, device), messages.encode("receipt", receipt), qos=1)

    def _weight_and_steps(self, device: str, update: messages.Update) -> tuple[float, int, str]:
        steps = update.metrics.get("steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise Rejected("schema", f"metric 'steps' must be a positive integer, got {steps!r}")
        trusted = self.sample_weights.weigh(device, update.num_samples)
        note = "" if trusted.note.startswith("cold start") else trusted.note
        if note:
            self.metrics.bounded.labels("weight").inc()
            log.warning("update from %s: %s", device, note)
        try:
            weight = float(self.server_rule.weight(trusted.weight, update.metrics))
        except (ValueError, TypeError, KeyError) as exc:
            raise Rejected("schema", f"metrics unusable by {self.algorithm.name}: {exc}") from None
        if not (weight > 0 and weight < float("inf")):
            raise Rejected("schema", f"aggregation weight {weight} is not positive and finite")
        return weight, steps, note

    def _validate(self, current: Round | None, device: str, data: bytes, arrived: float, digest: str
                  ) -> tuple[messages.Update, dict, float, int, str] | messages.Refusal | None:
        """The update, its decoded tensors, weight and steps; a refusal; or None for a resend of an
        update already accepted. Raises Rejected with the reason."""
        refused = self.admission(device) if self.admission else None
        if refused:
            raise Rejected(*refused)
        # size cap and the device's signature come first: nothing is parsed before them
        answer = messages.decode_answer(data, self.max_update_bytes, self.device_keys.get(device), device)
        if answer.device != device:
            raise Rejected("sender", f"topic says {device} but the update claims {answer.device}")
        if answer.federation != self.fed:
            raise Rejected("federation", f"update is for federation {answer.federation!r}, this is {self.fed!r}")
        key = (device, answer.round, answer.attempt)
        if key in self.accepted:
            still_open = current is not None and (current.number, current.attempt) == key[1:]
            if self.accepted[key] == digest and still_open:
                log.info("update from %s for round %d (attempt %d) arrived again; receipt re-sent",
                         device, answer.round, answer.attempt)
                self._receipt(device, None, None, (answer.round, answer.attempt))
                return None
            raise Rejected("replay", f"{device} already had an update accepted for round {answer.round} "
                                     f"(attempt {answer.attempt})")
        try:
            self._check_fresh(current, device, answer, arrived)
        except Rejected as exc:
            exc.answer = (answer.round, answer.attempt)  # type: ignore[attr-defined]
            raise
        assert current is not None
        if isinstance(answer, messages.Refusal):
            return answer
        update = answer
        if update.codec != codec.parse(self.settings.codec).name:
            raise Rejected("codec", f"update uses codec {update.codec!r}, the task asked for {self.settings.codec!r}")
        delta = codec.decode(update.codec, update.specs, update.body, {**self.specs, **self.extra_specs},
                             self.max_values)
        bound = self.settings.max_update_norm
        if bound and (norm := l2_norm({name: delta[name] for name in self.specs})) > bound:
            raise Rejected("norm", f"update norm {norm:.4g} exceeds the bound {bound:.4g}")
        return (update, delta, *self._weight_and_steps(device, update))

    def _check_fresh(self, current: Round | None, device: str, answer: messages.Update | messages.Refusal,
                     arrived: float) -> None:
        if answer.round in self.closed_at and (current is None or answer.round != current.number):
            raise Rejected("late", f"round {answer.round} closed at {_clock(self.closed_at[answer.round])}, "
                                   f"update arrived {_clock(arrived)}")
        if current is None or answer.round != current.number:
            open_round = f"round {current.number} is open" if current else "no round is open"
            raise Rejected("stale", f"update is for round {answer.round}; {open_round}")
        if answer.attempt != current.attempt:
            raise Rejected("stale", f"update is for attempt {answer.attempt} of round {answer.round}; "
                                    f"attempt {current.attempt} is open")
        if arrived > current.deadline:
            raise Rejected("late", f"round {current.number} closed at {_clock(current.deadline)}, "
                                   f"update arrived {_clock(arrived)}")
        if device not in current.cohort:
            raise Rejected("not_selected", f"{device} was not selected for round {current.number}")
        if device in current.answered or device in current.refused:
            raise Rejected("duplicate", f"{device} already answered round {current.number}")
        if isinstance(answer, messages.Update) and answer.model_version != current.base_version:
            raise Rejected("stale", f"update was trained on model version {answer.model_version}, "
                                    f"round {current.number} distributed version {current.base_version}")

    # presence -----------------------------------------------------------------------
    def eligible(self) -> list[str]:
        """Online devices that are not busy with an earlier task and that the registry admits."""
        now = time.time()
        self.pending_until = {d: t for d, t in self.pending_until.items() if t > now}
        return [d for d, profile in self.online.items()
                if not profile.get("busy") and d not in self.pending_until and self._is_admitted(d)]

    def _is_admitted(self, device: str) -> bool:
        """Presence comes from retained statuses anyone enrolled could have left: only devices the
        registry admits (active, not revoked) are selected. Answers are cached for a few seconds."""
        if self.admission is None:
            return True
        when, admitted = self._admitted
        if time.monotonic() - when > 5.0 or admitted is None:
            admitted = {d for d in self.online if self.admission(d) is None}
            self._admitted = (time.monotonic(), admitted)
        return device in admitted

    def _settle_presence(self, quiet: float = 0.5, limit: float = 5.0) -> None:
        """After (re)connecting, read the retained statuses until they stop arriving, so the first
        cohort is chosen from every device that is online, not from the first few to be heard."""
        give_up, last = time.monotonic() + limit, len(self.online)
        quiet_since = time.monotonic()
        while time.monotonic() < give_up and time.monotonic() - quiet_since < quiet:
            self._drain(0.1)
            if len(self.online) != last:
                last, quiet_since = len(self.online), time.monotonic()
        self._presence_settled = True

    def wait_for_devices(self, count: int, timeout: float, progress: Callable[[int, int], None] | None = None) -> None:
        give_up = time.monotonic() + timeout
        last_seen = -1
        while len(self.eligible()) < count:
            if self.stopping.is_set():
                raise RoundFailed("shutting down")
            if time.monotonic() > give_up:
                raise TimeoutError(f"only {len(self.eligible())} of {count} devices were online and idle "
                                   f"within {timeout:.0f} s")
            if progress and len(self.online) != last_seen:
                last_seen = len(self.online)
                progress(last_seen, count)
            self._drain(0.2)
        if progress:
            progress(len(self.online), count)

    # rounds -------------------------------------------------------------------------
    def _publish_model(self, deadline: float) -> None:
        """Once per version: retained chunks, then the retained manifest; clear the previous version."""
        assert self.session is not None
        if self._published and self._published[0] == self.version:
            return
        tensors = {**self.weights, **self.server_rule.broadcast_tensors()}  # e.g. FedSMOO's global perturbation
        manifest, chunks = downlink.release(self.version, self.arch, tensors, self.settings.model_codec,
                                            self.settings.model_chunk_bytes)
        self._model_payloads = [(topics.model_chunk(self.fed, self.version, i), c) for i, c in enumerate(chunks)]
        self._model_payloads.append((topics.model(self.fed, self.version), messages.encode("model", manifest)))
        for topic, payload in self._model_payloads:
            if not self.session.publish_until(topic, payload, deadline, retain=True):
                raise RoundFailed(f"could not publish model version {self.version} before the deadline")
        if self._published:  # clear the previous version's retained copies
            old, count = self._published
            self.session.publish(topics.model(self.fed, old), b"", qos=1, retain=True)
            for i in range(count):
                self.session.publish(topics.model_chunk(self.fed, old, i), b"", qos=1, retain=True)
        self._published = (self.version, len(chunks))

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
        cohort = set(select(s.selection, eligible, k, self.rng, self.last_metrics))
        self.server_rule.start_round(round_no, len(self.online))
        self.extras = StreamingMean(self.extra_specs) if self.extra_specs else None
        self.sample_weights.start_round()
        rnd = Round(round_no, attempt, cohort, deadline, self.version,
                    RobustRound(self.specs, self.norm_bound, s.aggregator, s.trim, s.normalize_steps,
                                self._reference(round_no)))
        if self.on_state:
            self.on_state(rnd)
        if len(cohort) < s.min_updates:
            self._set_state(rnd, RoundState.ABANDONED,
                            f"only {len(cohort)} devices online and idle, quorum is {s.min_updates}")
            return rnd
        self._publish_model(deadline)
        task = messages.Task(round_no, self.version, deadline, s.algorithm, s.task_hparams(round_no),
                             self.server_rule.broadcast(), s.codec, attempt)
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
        self._set_state(rnd, RoundState.COLLECTING)
        while not rnd.complete and time.time() < deadline and not self.stopping.is_set():
            self._drain(min(0.5, deadline - time.time()), rnd)
        count = rnd.aggregate.count
        if self.stopping.is_set():
            self._set_state(rnd, RoundState.ABANDONED, "coordinator shutting down")
        elif count >= s.min_updates:
            self._set_state(rnd, RoundState.CLOSED, "all selected devices answered" if rnd.complete
                            else f"deadline passed with {count} of {len(cohort)} updates")
        else:
            why = f"{count} of {len(cohort)} updates at the deadline, quorum is {s.min_updates}"
            if rnd.refused:
                reasons = Counter(rnd.refused.values()).most_common(2)
                why += f"; {len(rnd.refused)} refused the task ({'; '.join(r for r, _ in reasons)})"
            if unsent:
                why += f"; {len(unsent)} tasks could not be published"
            self._set_state(rnd, RoundState.ABANDONED, why)
        return rnd

    def run_round(self, round_no: int | None = None) -> RoundRecord:
        """Run the next round to its end, retrying with a new cohort while there is no quorum."""
        round_no = round_no or self.next_round
        base_sha = model_sha256(self.weights)
        # attempt numbers never repeat for a round, across restarts too: an answer names its attempt
        attempt = max(self.attempts.get(round_no, 0), self.store.last_attempt(round_no) if self.store else 0)
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
            if self.store:
                self.store.record_round(asdict(self._record(rnd, base_sha, base_sha, "abandoned")))
            if self.stopping.is_set():
                raise RoundFailed(f"round {round_no} abandoned: {rnd.reason}")
            if self.settings.max_attempts and attempt >= self.settings.max_attempts:
                raise RoundFailed(f"round {round_no} found no quorum in {attempt} attempts: {rnd.reason}")
        return self._conclude(rnd, base_sha)

    def fold_round(self, answers: Mapping[str, bytes], round_no: int | None = None) -> RoundRecord:
        """A round without a broker: the answers (device -> signed payload, as published) go through
        the same validation, trust bounds and fold as over MQTT. For benchmarks and tests."""
        round_no = round_no or self.next_round
        base_sha = model_sha256(self.weights)
        self.server_rule.start_round(round_no, len(answers))
        self.extras = StreamingMean(self.extra_specs) if self.extra_specs else None
        self.sample_weights.start_round()
        s = self.settings
        rnd = Round(round_no, 1, set(answers), time.time() + s.round_timeout, self.version,
                    RobustRound(self.specs, self.norm_bound, s.aggregator, s.trim, s.normalize_steps,
                                self._reference(round_no)))
        rnd.move(RoundState.COLLECTING)
        for device, payload in answers.items():
            self._on_update(rnd, device, payload, time.time())
        if rnd.aggregate.count == 0:
            rnd.move(RoundState.ABANDONED, "no update was accepted")
            raise RoundFailed(f"round {round_no}: no update was accepted ({dict(rnd.rejected)})")
        rnd.move(RoundState.CLOSED)
        return self._conclude(rnd, base_sha)

    def _reference(self, round_no: int) -> Callable[[list[str]], np.ndarray] | None:
        if self.settings.reference == "median" or self.root_set is None:
            return None
        base = dict(self.weights)  # the model this round's devices trained from
        lr = float(self.settings.task_hparams(round_no)["lr"])
        return lambda names: root_direction(self.arch, base, self.root_set, names, lr, seed=round_no)

    def _conclude(self, rnd: Round, base_sha: str) -> RoundRecord:
        """A closed round: the server rule's new global model, evaluation, checkpoint."""
        round_no = rnd.number
        self.closed_at[round_no] = time.time()
        self.weights = self.server_rule.new_global(self.weights, rnd.aggregate.mean(),
                                                   self.extras.mean() if self.extras is not None else None)
        self.version += 1
        set_weights(self.model, self.weights)
        set_weights(self.served_model, self.served.update(self.weights))
        self._set_state(rnd, RoundState.AGGREGATED)
        accuracy, loss = evaluate(self.served_model, self.test_set)
        self._set_state(rnd, RoundState.EVALUATED)
        record = self._record(rnd, base_sha, model_sha256(self.weights),
                              "complete" if rnd.complete else "deadline", accuracy, loss)
        if self.store:
            self.store.save_checkpoint(Checkpoint(round_no, self.version, self.arch, self.weights,
                                                  record.model_sha256, self.server_rule.state(), asdict(record),
                                                  self.served.weights if self.settings.serve_average else None,
                                                  {"weights": self.sample_weights.state(),
                                                   "norms": self.norm_bound.state()}))
            self.store.record_round(asdict(record))
        self._set_state(rnd, RoundState.CHECKPOINTED)
        self.next_round = round_no + 1
        self.metrics.rounds.labels(record.closed).inc()
        self.metrics.round_seconds.observe(record.seconds)
        self.metrics.accuracy.set(accuracy)
        self.metrics.loss.set(loss)
        self.metrics.round.set(round_no)
        return record

    def _record(self, rnd: Round, base_sha: str, model_sha: str, closed: str,
                accuracy: float = float("nan"), loss: float = float("nan")) -> RoundRecord:
        clipped = {"norm": len(rnd.aggregate.clipped)} if rnd.aggregate.clipped else {}
        for device, (norm, bound) in rnd.aggregate.clipped.items():
            log.warning("round %d: update from %s clipped from norm %.4g to %.4g", rnd.number, device, norm, bound)
            self.metrics.bounded.labels("norm").inc()
        if rnd.weights_clipped:
            clipped["weight"] = rnd.weights_clipped
        for device, cosine in rnd.aggregate.gated.items():
            log.warning("round %d: update from %s left out: it points away from the round's median "
                        "(cosine %.2f)", rnd.number, device, cosine)
            self.metrics.bounded.labels("direction").inc()
            rnd.device_metrics.setdefault(device, {})["left_out"] = f"direction (cosine {cosine:.2f})"
        for device, (norm, bound) in rnd.aggregate.clipped.items():
            rnd.device_metrics.setdefault(device, {})["clipped_norm"] = f"{norm:.4g} -> {bound:.4g}"
        if rnd.aggregate.gated:
            clipped["direction"] = len(rnd.aggregate.gated)
        return RoundRecord(rnd.number, rnd.attempt, rnd.aggregate.count, len(rnd.cohort), accuracy, loss,
                           rnd.bytes_up, time.time() - rnd.started, dict(rnd.rejected), closed, base_sha,
                           model_sha, rnd.device_metrics, clipped, dict(rnd.refused), rnd.reason)


def record_dict(record: RoundRecord) -> dict[str, Any]:
    return asdict(record)
