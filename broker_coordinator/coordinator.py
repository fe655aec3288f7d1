"""The coordinator: rounds over MQTT, driven by the state machine in `rounds`.

paho's network thread only queues raw messages; every decision happens on the
thread that calls `run_round`, so nothing here needs a lock. Each round is
checkpointed (model, server state, round record) before the database learns of
it, so a coordinator killed at any point resumes without aggregating a round
twice (see `store`).

Every update is hostile until validated: size cap, then the device's HMAC
signature (before anything is parsed), then sender, federation, replay,
round and model-version freshness, deadline, cohort, codec, shapes, finite
values and the optional norm bound. A rejection is logged with its reason,
counted per reason and never touches the global model.
"""

from __future__ import annotations

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
from edgefl_protocol.transport import Session
from models.architectures import build_model, get_weights, set_weights
from models.datasets import Dataset

from .aggregation import StreamingMean
from .broker import COORDINATOR_USER
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
    max_update_norm: float = 0.0  # reject deltas whose L2 norm exceeds this; 0 = no bound
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
            (0 <= self.serve_average < 1, "serve_average must be in [0, 1) (the decay of the served moving "
                                          "average of global models; 0 = serve the last global model)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
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


class RoundFailed(Exception):
    """A round found no quorum in any of its attempts."""


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


class Coordinator:
    def __init__(self, federation: str, arch: str, test_set: Dataset, settings: RoundSettings, seed: int = 0,
                 store: Store | None = None, metrics: Metrics | None = None,
                 on_state: Callable[[Round], None] | None = None,
                 device_keys: Mapping[str, bytes] | None = None) -> None:
        settings.validate()
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
        self.max_update_bytes = 4 * self.max_values + 64 * 1024
        self.rng = random.Random(seed)
        self.online: dict[str, dict[str, Any]] = {}
        self.pending_until: dict[str, float] = {}  # tasked devices that have not answered yet
        self.pending_round: dict[str, int] = {}
        self.last_metrics: dict[str, dict[str, Any]] = {}
        self.closed_at: dict[int, float] = {}
        self.rejections: Counter[str] = Counter()
        self.device_keys: dict[str, bytes] = dict(device_keys or {})  # device -> HMAC key (from enrollment)
        self.accepted: set[tuple[str, int]] = set()  # (device, round) of every accepted update: replay guard
        # device -> None (admitted) or (reason, detail); e.g. Registry.admission, which rejects
        # unknown and revoked devices. None: every device the broker lets in is admitted (simulate).
        self.admission: Callable[[str], tuple[str, str] | None] | None = None
        self.inbox: queue.Queue[tuple[str, bytes, float]] = queue.Queue()
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
        self.served.weights = ckpt.served if ckpt.served is not None else dict(self.weights)
        self.rng.seed(f"{ckpt.sha256}/{ckpt.round}")
        log.warning("resumed from the checkpoint of round %d (model version %d, sha256 %s)",
                    ckpt.round, ckpt.version, ckpt.sha256[:12])

    # session ------------------------------------------------------------------------
    def connect(self, host: str, port: int, username: str = COORDINATOR_USER, password: str = "",
                keepalive: int = 60, timeout: float = 30.0) -> None:
        self.session = Session(f"{COORDINATOR_USER}-{self.fed}", username, password, host, port,
                               on_connect=self._on_connect,
                               on_message=lambda c, msg: self.inbox.put((msg.topic, msg.payload, time.time())),
                               keepalive=keepalive)
        self.session.start(timeout)

    def _on_connect(self, client) -> None:  # noqa: ANN001 (paho client, on paho's thread)
        # Presence is re-learnt from the retained statuses the subscription delivers.
        self.inbox.put(("", b"reset-presence", time.time()))
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
            topic, payload, arrived = self.inbox.get(timeout=max(timeout, 0.0))
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
        elif kind == "update":
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
        try:
            update, delta = self._validate(current, device, data, arrived)
            self._weight_and_steps(update)  # reject bad metrics before anything is folded in
        except Rejected as exc:
            self._reject(device, exc.reason, exc.detail, current)
            if self.store and current is not None:
                self.store.record_device_round(current.number, current.attempt, device, False, exc.reason, None)
            return
        assert current is not None
        weight, steps = self._weight_and_steps(update)
        current.aggregate.add({name: delta[name] for name in self.specs}, weight, steps)
        if self.extras is not None:
            self.extras.add({name: delta[name] for name in self.extra_specs}, 1.0)
        self.server_rule.observe(device, update.num_samples, update.metrics)
        current.answered.add(device)
        self.accepted.add((device, current.number))
        current.device_metrics[device] = dict(update.metrics, num_samples=update.num_samples)
        current.bytes_up += len(data)
        self.last_metrics[device] = dict(update.metrics)
        self.metrics.accepted.inc()
        self.metrics.bytes_up.inc(len(data))
        if self.store:
            self.store.record_device_round(current.number, current.attempt, device, True, None,
                                           current.device_metrics[device])

    def _weight_and_steps(self, update: messages.Update) -> tuple[float, int]:
        steps = update.metrics.get("steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise Rejected("schema", f"metric 'steps' must be a positive integer, got {steps!r}")
        try:
            weight = float(self.server_rule.weight(update.num_samples, update.metrics))
        except (ValueError, TypeError, KeyError) as exc:
            raise Rejected("schema", f"metrics unusable by {self.algorithm.name}: {exc}") from None
        if not (weight > 0 and weight < float("inf")):
            raise Rejected("schema", f"aggregation weight {weight} is not positive and finite")
        return weight, steps

    def _validate(self, current: Round | None, device: str, data: bytes,
                  arrived: float) -> tuple[messages.Update, dict]:
        refused = self.admission(device) if self.admission else None
        if refused:
            raise Rejected(*refused)
        # size cap and the device's signature come first: nothing is parsed before them
        update = messages.decode_update(data, self.max_update_bytes, self.device_keys.get(device), device)
        if update.device != device:
            raise Rejected("sender", f"topic says {device} but the update claims {update.device}")
        if update.federation != self.fed:
            raise Rejected("federation", f"update is for federation {update.federation!r}, this is {self.fed!r}")
        if (device, update.round) in self.accepted:
            raise Rejected("replay", f"{device} already had an update accepted for round {update.round}")
        if update.round in self.closed_at and (current is None or update.round != current.number):
            raise Rejected("late", f"round {update.round} closed at {_clock(self.closed_at[update.round])}, "
                                   f"update arrived {_clock(arrived)}")
        if current is None or update.round != current.number:
            open_round = f"round {current.number} is open" if current else "no round is open"
            raise Rejected("stale", f"update is for round {update.round}; {open_round}")
        if arrived > current.deadline:
            raise Rejected("late", f"round {current.number} closed at {_clock(current.deadline)}, "
                                   f"update arrived {_clock(arrived)}")
        if device not in current.cohort:
            raise Rejected("not_selected", f"{device} was not selected for round {current.number}")
        if device in current.answered:
            raise Rejected("duplicate", f"{device} already answered round {current.number}")
        if update.model_version != current.base_version:
            raise Rejected("stale", f"update was trained on model version {update.model_version}, "
                                    f"round {current.number} distributed version {current.base_version}")
        if update.codec != codec.parse(self.settings.codec).name:
            raise Rejected("codec", f"update uses codec {update.codec!r}, the task asked for {self.settings.codec!r}")
        delta = codec.decode(update.codec, update.specs, update.body, {**self.specs, **self.extra_specs},
                             self.max_values)
        bound = self.settings.max_update_norm
        if bound and (norm := _norm({name: delta[name] for name in self.specs})) > bound:
            raise Rejected("norm", f"update norm {norm:.4g} exceeds the bound {bound:.4g}")
        return update, delta

    # presence -----------------------------------------------------------------------
    def eligible(self) -> list[str]:
        """Online devices that are not busy with an earlier task."""
        now = time.time()
        self.pending_until = {d: t for d, t in self.pending_until.items() if t > now}
        return [d for d, profile in self.online.items() if not profile.get("busy") and d not in self.pending_until]

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
        deadline = time.time() + s.round_timeout
        # wait (within this attempt's deadline) until a quorum of devices is eligible
        while len(self.eligible()) < s.min_updates and time.time() < deadline and not self.stopping.is_set():
            self._drain(min(0.5, deadline - time.time()))
        eligible = self.eligible()
        k = len(eligible) if s.clients_per_round == 0 else s.clients_per_round
        cohort = set(select(s.selection, eligible, k, self.rng, self.last_metrics))
        self.server_rule.start_round(round_no, len(self.online))
        self.extras = StreamingMean(self.extra_specs) if self.extra_specs else None
        rnd = Round(round_no, attempt, cohort, deadline, self.version,
                    StreamingMean(self.specs, normalize_steps=s.normalize_steps))
        if self.on_state:
            self.on_state(rnd)
        if len(cohort) < s.min_updates:
            self._set_state(rnd, RoundState.ABANDONED,
                            f"only {len(cohort)} devices online and idle, quorum is {s.min_updates}")
            return rnd
        self._publish_model(deadline)
        task = messages.Task(round_no, self.version, deadline, s.algorithm, s.task_hparams(round_no),
                             self.server_rule.broadcast(), s.codec)
        payload = messages.encode("task", task)
        assert self.session is not None
        for device in sorted(cohort):
            self.session.publish(topics.task(self.fed, device), payload, qos=1)
            # after the deadline the retained status says whether it is still training (busy)
            self.pending_until[device] = deadline
            self.pending_round[device] = round_no
        self._set_state(rnd, RoundState.COLLECTING)
        while not rnd.complete and time.time() < deadline and not self.stopping.is_set():
            self._drain(min(0.5, deadline - time.time()), rnd)
        if self.stopping.is_set():
            self._set_state(rnd, RoundState.ABANDONED, "coordinator shutting down")
        elif rnd.aggregate.count >= s.min_updates:
            self._set_state(rnd, RoundState.CLOSED, "all selected devices answered" if rnd.complete
                            else f"deadline passed with {rnd.aggregate.count} of {len(cohort)} updates")
        else:
            self._set_state(rnd, RoundState.ABANDONED, f"{rnd.aggregate.count} of {len(cohort)} updates at the "
                                                       f"deadline, quorum is {s.min_updates}")
        return rnd

    def run_round(self, round_no: int | None = None) -> RoundRecord:
        """Run the next round to its end, retrying with a new cohort while there is no quorum."""
        round_no = round_no or self.next_round
        base_sha = model_sha256(self.weights)
        attempt = 0
        while True:
            attempt += 1
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
                                                  self.served.weights if self.settings.serve_average else None))
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
        return RoundRecord(rnd.number, rnd.attempt, rnd.aggregate.count, len(rnd.cohort), accuracy, loss,
                           rnd.bytes_up, time.time() - rnd.started, dict(rnd.rejected), closed, base_sha,
                           model_sha, rnd.device_metrics)


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(a.ravel().astype(np.float64), a.ravel())) for a in tensors.values())))


def record_dict(record: RoundRecord) -> dict[str, Any]:
    return asdict(record)
