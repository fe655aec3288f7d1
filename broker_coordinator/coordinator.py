"""The coordinator's round loop over MQTT.

One round:
  1. publish the global model once per version (retained) and a task per
     selected device, with a deadline;
  2. validate every update that arrives (size cap, then the device's HMAC
     signature before anything is parsed, then schema, sender, replay, round
     and model-version freshness, cohort, deadline, codec, shapes, finite
     values, norm bound) and fold it into a streaming weighted mean;
  3. close when every selected device has answered, or at the deadline if at
     least `min_updates` arrived; apply the server rule; evaluate.

paho's network thread only queues raw messages; all decisions happen on the
caller's thread, so no locks guard the model.
"""

from __future__ import annotations

import logging
import queue
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgefl_protocol import algorithms, codec, downlink, messages, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.transport import connect, make_client
from models.architectures import build_model, get_weights, set_weights
from models.datasets import Dataset

from .aggregation import StreamingMean
from .broker import COORDINATOR_USER
from .evaluation import evaluate

log = logging.getLogger("broker_coordinator")


@dataclass
class RoundSettings:
    algorithm: str = algorithms.DEFAULT_ALGORITHM
    clients_per_round: int = 0  # 0: every online device
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.05
    lr_decay: float = 0.998  # per round
    momentum: float = 0.0
    weight_decay: float = 1e-3
    grad_clip: float = 10.0
    round_timeout: float = 300.0  # seconds from task to deadline
    min_updates: int = 1  # quorum needed to close a round at its deadline
    codec: str = "float32"  # uplink codec the tasks name (see edgefl_protocol.codec)
    model_codec: str = "float32"  # downlink: float32 (lossless) or float16, optionally +zlib
    model_chunk_bytes: int = downlink.DEFAULT_CHUNK_BYTES
    max_update_norm: float = 0.0  # reject deltas whose L2 norm exceeds this; 0 = no bound
    hparams: dict[str, float] = field(default_factory=dict)  # algorithm-specific, over its defaults

    def validate(self) -> None:
        algorithms.get(self.algorithm)
        checks = [
            (self.clients_per_round >= 0, "clients_per_round must be >= 0 (0 = all online devices)"),
            (self.local_epochs >= 1, "local_epochs must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.lr > 0, "lr must be > 0"),
            (0 < self.lr_decay <= 1, "lr_decay must be in (0, 1]"),
            (0 <= self.momentum < 1, "momentum must be in [0, 1)"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.round_timeout > 0, "round_timeout must be > 0"),
            (self.min_updates >= 1, "min_updates must be >= 1"),
            (self.model_chunk_bytes >= 1024, "model_chunk_bytes must be >= 1024"),
            (self.max_update_norm >= 0, "max_update_norm must be >= 0 (0 = no bound)"),
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
    participants: int
    selected: int
    accuracy: float
    loss: float
    bytes_up: int
    seconds: float
    rejected: dict[str, int]
    closed: str  # "complete" | "deadline" | "abandoned"


class Coordinator:
    def __init__(self, federation: str, arch: str, test_set: Dataset, settings: RoundSettings,
                 seed: int = 0, device_keys: Mapping[str, bytes] | None = None) -> None:
        settings.validate()
        self.fed = topics.check_name("federation", federation)
        self.arch = arch
        self.settings = settings
        self.model = build_model(arch, seed)
        self.weights = get_weights(self.model)
        self.specs = codec.specs_of(self.weights)
        self.max_values = sum(a.size for a in self.weights.values())
        self.max_update_bytes = 4 * self.max_values + 64 * 1024
        self.test_set = test_set
        self.version = 0
        self.algorithm = algorithms.get(settings.algorithm)
        self.server_rule = self.algorithm.server(settings.task_hparams(1))
        self.rng = random.Random(seed)
        self.online: dict[str, dict[str, Any]] = {}
        self.rejections: Counter[str] = Counter()
        self.device_keys: dict[str, bytes] = dict(device_keys or {})  # device -> HMAC key (enrollment)
        self.accepted: set[tuple[str, int]] = set()  # (device, round) of every accepted update: replay guard
        self.published: tuple[int, int] | None = None  # (version, chunks) of the retained model
        self.inbox: queue.Queue[tuple[str, bytes, float]] = queue.Queue()
        self.client = make_client(f"{COORDINATOR_USER}-{federation}", COORDINATOR_USER, "")
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, msg: self.inbox.put((msg.topic, msg.payload, time.time()))

    # session ------------------------------------------------------------------------
    def connect(self, host: str, port: int, username: str, password: str) -> None:
        self.client.username_pw_set(username, password)
        connect(self.client, host, port)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if not reason_code.is_failure:
            client.subscribe([(topics.all_updates(self.fed), 1), (topics.all_statuses(self.fed), 1)])

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _drain(self, timeout: float, round_no: int | None = None, fold: Any = None) -> None:
        """Handle one queued message (or wait up to `timeout` for one)."""
        try:
            topic, payload, arrived = self.inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return
        parsed = topics.parse_device_topic(topic)
        if parsed is None or parsed[0] != self.fed:
            return
        _, device, kind = parsed
        if kind == "status":
            self._on_status(device, payload)
        elif kind == "update":
            if fold is None:
                self._reject(device, "stale", "no round is open")
            else:
                fold(device, payload, arrived)

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
        else:
            self.online.pop(device, None)

    def _reject(self, device: str, reason: str, detail: str) -> None:
        self.rejections[reason] += 1
        log.warning("update from %s rejected: %s: %s", device, reason, detail)

    def _check_header(self, update: messages.Update, device: str, round_no: int) -> None:
        """Header checks after the signature: sender, federation, replay, freshness, codec."""
        if update.device != device:
            raise Rejected("sender", f"topic says {device} but the update claims {update.device}")
        if update.federation != self.fed:
            raise Rejected("federation", f"update is for federation {update.federation!r}, this is {self.fed!r}")
        if (device, update.round) in self.accepted:
            raise Rejected("replay", f"{device} already had an update accepted for round {update.round}")
        if update.round != round_no:
            raise Rejected("stale", f"update is for round {update.round}, round {round_no} is open")
        if update.model_version != self.version:
            raise Rejected("stale_model", f"update was trained from model version {update.model_version}, "
                                          f"the current version is {self.version}")
        if update.codec != codec.parse(self.settings.codec).name:
            raise Rejected("codec", f"update uses codec {update.codec!r}, the task asked for {self.settings.codec!r}")

    def _check_norm(self, delta: Mapping[str, np.ndarray]) -> None:
        bound = self.settings.max_update_norm
        if bound and (norm := _norm(delta)) > bound:
            raise Rejected("norm", f"update norm {norm:.4g} exceeds the bound {bound:.4g}")

    def wait_for_devices(self, count: int, timeout: float, progress: Any = None) -> None:
        give_up = time.monotonic() + timeout
        last_seen = -1
        while len(self.online) < count:
            if time.monotonic() > give_up:
                raise TimeoutError(f"only {len(self.online)} of {count} devices came online within {timeout:.0f} s")
            if progress and len(self.online) != last_seen:
                last_seen = len(self.online)
                progress(last_seen, count)
            self._drain(0.2)
        if progress:
            progress(len(self.online), count)

    # rounds -------------------------------------------------------------------------
    def _publish_model(self) -> None:
        """Once per version: retained chunks, then the retained manifest; clear the previous version."""
        if self.published and self.published[0] == self.version:
            return
        manifest, chunks = downlink.release(self.version, self.arch, self.weights, self.settings.model_codec,
                                            self.settings.model_chunk_bytes)
        for i, chunk in enumerate(chunks):
            self.client.publish(topics.model_chunk(self.fed, self.version, i), chunk, qos=1, retain=True)
        self.client.publish(topics.model(self.fed, self.version), messages.encode("model", manifest),
                            qos=1, retain=True).wait_for_publish(timeout=30)
        if self.published:  # clear the previous version's retained copies
            old, count = self.published
            self.client.publish(topics.model(self.fed, old), b"", qos=1, retain=True)
            for i in range(count):
                self.client.publish(topics.model_chunk(self.fed, old, i), b"", qos=1, retain=True)
        self.published = (self.version, len(chunks))

    def run_round(self, round_no: int) -> RoundRecord:
        started = time.time()
        s = self.settings
        online = sorted(self.online)
        k = len(online) if s.clients_per_round == 0 else min(s.clients_per_round, len(online))
        cohort = set(self.rng.sample(online, k))
        self._publish_model()
        deadline = started + s.round_timeout
        task = messages.Task(round_no, self.version, deadline, s.algorithm, s.task_hparams(round_no),
                             self.server_rule.broadcast(), s.codec)
        payload = messages.encode("task", task)
        for device in sorted(cohort):
            self.client.publish(topics.task(self.fed, device), payload, qos=1)

        aggregate = StreamingMean(self.specs)
        answered: set[str] = set()
        bytes_up = 0
        rejected_before = Counter(self.rejections)

        def fold(device: str, data: bytes, arrived: float) -> None:
            nonlocal bytes_up
            try:
                # size cap and the device's signature come first: nothing is parsed before them
                update = messages.decode_update(data, self.max_update_bytes, self.device_keys.get(device), device)
                self._check_header(update, device, round_no)
                if device not in cohort:
                    raise Rejected("not_selected", f"{device} was not selected for round {round_no}")
                if arrived > deadline:
                    raise Rejected("late", f"round {round_no} closed at {time.strftime('%H:%M:%S', time.localtime(deadline))}, "
                                           f"update arrived {time.strftime('%H:%M:%S', time.localtime(arrived))}")
                delta = codec.decode(update.codec, update.specs, update.body, self.specs, self.max_values)
                self._check_norm(delta)
                weight = self.server_rule.weight(update.num_samples, update.metrics)
            except Rejected as exc:
                self._reject(device, exc.reason, exc.detail)
                return
            aggregate.add(delta, weight)
            answered.add(device)
            self.accepted.add((device, round_no))
            bytes_up += len(data)

        while answered != cohort and time.time() < deadline:
            self._drain(min(0.5, deadline - time.time()), round_no, fold)

        closed = "complete" if answered == cohort else "deadline"
        if aggregate.count >= s.min_updates:
            self.weights = self.server_rule.new_global(self.weights, aggregate.mean())
            self.version += 1
            set_weights(self.model, self.weights)
        else:
            closed = "abandoned"
            log.warning("round %d abandoned: %d of %d updates at the deadline, quorum is %d; model unchanged",
                        round_no, aggregate.count, len(cohort), s.min_updates)
        accuracy, loss = evaluate(self.model, self.test_set)
        new_rejections = self.rejections - rejected_before
        return RoundRecord(round_no, aggregate.count, len(cohort), accuracy, loss, bytes_up,
                           time.time() - started, dict(new_rejections), closed)


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.dot(a.ravel().astype(np.float64), a.ravel())) for a in tensors.values())))


def record_dict(record: RoundRecord) -> dict[str, Any]:
    return asdict(record)
