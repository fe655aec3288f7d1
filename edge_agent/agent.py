"""The agent's MQTT session: wait for a task, fetch the model, train, publish.

paho's network thread only decodes and queues; training runs on the main
thread so the session keeps answering keepalives while the CPU is busy.

The model arrives as a retained manifest per version; the agent subscribes to
that version's chunks only when it does not already hold the same bytes
(sha256, kept in memory and in `model.bin` in the state dir), reassembles
and verifies them. The delta goes out with the codec the task names; for
top-k codecs the error-feedback residual is kept in the device state.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import signal
import threading
import time
import zlib
from pathlib import Path

import torch

from edgefl_protocol import algorithms, codec, downlink, messages, signing, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.transport import connect, make_client
from models.architectures import build_model, get_weights, set_weights
from models.datasets import load_npz

from .config import AgentConfig
from .state import DeviceState, atomic_write
from .training import LocalSettings, train_locally

log = logging.getLogger("edge_agent")
MAX_MODEL_BYTES = 64 * 1024 * 1024
MAX_MODEL_VALUES = 16 * 1024 * 1024
MODEL_CACHE = "model.bin"


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.fed, self.device = config.device.federation, config.device.id
        self.data = load_npz(config.device.data)
        self.tasks: queue.Queue[messages.Task] = queue.Queue(maxsize=16)
        self.models: dict[int, tuple[messages.ModelRelease, bytes]] = {}  # version -> manifest, verified body
        self.assemblies: dict[int, downlink.Assembly] = {}  # versions being fetched
        self.cached: tuple[str, bytes] | None = self._load_cached_model()  # (sha256, body)
        self.models_changed = threading.Condition()
        key = config.device.signing_key
        self.key = signing.key_from_hex(key) if key else None
        if self.key is None:
            log.error("no signing_key in [device]: the coordinator will reject every update from %s", self.device)
        self.stopping = threading.Event()
        self.state = DeviceState(config.device.state_dir)
        self.client = make_client(self.device, config.broker.username, config.broker.password)
        self.client.will_set(topics.status(self.fed, self.device), self._status("offline"), qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        threads = config.device.threads or max(1, (os.cpu_count() or 2) - 1)
        torch.set_num_threads(threads)

    def _status(self, state: str) -> bytes:
        profile = {"cores": os.cpu_count() or 1, "samples": len(self.data)}
        return messages.encode("status", messages.Status(self.device, state, profile))

    # paho callbacks (network thread) -------------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            log.error("broker refused %s: %s", self.device, reason_code)
            return
        client.subscribe([(topics.task(self.fed, self.device), 1), (topics.models(self.fed), 1)]
                         + [(topics.model_chunks(self.fed, v), 1) for v in list(self.assemblies)])
        client.publish(topics.status(self.fed, self.device), self._status("online"), qos=1, retain=True)
        log.info("connected as %s", self.device)

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        try:
            if msg.topic == topics.task(self.fed, self.device):
                task = messages.decode_task(msg.payload)
                self.tasks.put_nowait(task)
            elif (version := topics.parse_model_topic(msg.topic)) is not None and msg.payload:
                release = messages.decode_model(msg.payload, MAX_MODEL_BYTES)
                if release.version != version:
                    raise Rejected("schema", f"model topic says version {version}, message says {release.version}")
                self._on_manifest(client, release)
            elif (where := topics.parse_model_chunk_topic(msg.topic)) is not None and msg.payload:
                self._on_chunk(client, *where, msg.payload)
        except Rejected as exc:
            log.warning("ignored message on %s: %s", msg.topic, exc)
        except queue.Full:
            log.warning("task queue full; dropped a task on %s", msg.topic)

    def _on_manifest(self, client, release: messages.ModelRelease) -> None:  # noqa: ANN001
        with self.models_changed:
            if release.version in self.models or release.version in self.assemblies:
                return
            if self.cached and self.cached[0] == release.sha256:  # already have these bytes: no fetch
                self._ready(release, self.cached[1])
                return
            self.assemblies[release.version] = downlink.Assembly(release)
        client.subscribe(topics.model_chunks(self.fed, release.version), qos=1)

    def _on_chunk(self, client, version: int, index: int, data: bytes) -> None:  # noqa: ANN001
        with self.models_changed:
            assembly = self.assemblies.get(version)
            if assembly is None:
                return
            assembly.add(index, data)
            if not assembly.complete:
                return
            del self.assemblies[version]
        try:
            body = assembly.body()  # sha256 verified, or Rejected
        except Rejected:
            with self.models_changed:  # fetch again: resubscribing delivers the retained chunks anew
                self.assemblies[version] = downlink.Assembly(assembly.manifest)
            client.unsubscribe(topics.model_chunks(self.fed, version))
            client.subscribe(topics.model_chunks(self.fed, version), qos=1)
            raise
        client.unsubscribe(topics.model_chunks(self.fed, version))
        with self.models_changed:
            self._ready(assembly.manifest, body)

    def _ready(self, release: messages.ModelRelease, body: bytes) -> None:
        """Caller holds models_changed."""
        self.models = {v: m for v, m in self.models.items() if v > release.version - 2}
        self.models[release.version] = (release, body)
        self.models_changed.notify_all()

    def _load_cached_model(self) -> tuple[str, bytes] | None:
        path = Path(self.config.device.state_dir) / MODEL_CACHE
        try:
            body = path.read_bytes()
        except OSError:
            return None
        return hashlib.sha256(body).hexdigest(), body

    def _remember_model(self, release: messages.ModelRelease, body: bytes) -> None:
        """Keep the newest model's bytes (memory and disk) so a reconnect or restart does not fetch it again."""
        if self.cached and self.cached[0] == release.sha256:
            return
        self.cached = (release.sha256, body)
        try:
            Path(self.config.device.state_dir).mkdir(parents=True, exist_ok=True)
            atomic_write(Path(self.config.device.state_dir) / MODEL_CACHE, body)
        except OSError as exc:
            log.warning("cannot cache the model on disk: %s", exc)

    # main thread --------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        connect(self.client, self.config.broker.host, self.config.broker.port, self.config.broker.keepalive)
        try:
            while not self.stopping.is_set():
                try:
                    task = self.tasks.get(timeout=0.5)
                except queue.Empty:
                    continue
                self._handle(task)
        finally:
            info = self.client.publish(topics.status(self.fed, self.device), self._status("offline"), qos=1, retain=True)
            info.wait_for_publish(timeout=5)
            self.client.disconnect()
            self.client.loop_stop()
        log.info("stopped")
        return 0

    def _wait_for_model(self, version: int, deadline: float) -> tuple[messages.ModelRelease, bytes] | None:
        with self.models_changed:
            while version not in self.models:
                remaining = deadline - time.time()
                if remaining <= 0 or self.stopping.is_set():
                    return None
                self.models_changed.wait(min(remaining, 0.5))
            return self.models[version]

    def _handle(self, task: messages.Task) -> None:
        if time.time() > task.deadline:
            log.warning("round %d: task arrived after its deadline; skipped", task.round)
            return
        got = self._wait_for_model(task.model_version, task.deadline)
        if got is None:
            log.warning("round %d: model version %d never arrived; skipped", task.round, task.model_version)
            return
        release, body = got
        try:
            algorithm = algorithms.get(task.algorithm)
            model = build_model(release.arch)
            set_weights(model, downlink.decode_weights(release, body, codec.specs_of(get_weights(model)),
                                                       MAX_MODEL_VALUES))
            codec.parse(task.codec)
        except (ValueError, Rejected) as exc:
            log.error("round %d: cannot use task: %s", task.round, exc)
            return
        hp = task.hparams
        settings = LocalSettings(
            epochs=int(hp.get("local_epochs", 2)), batch_size=int(hp.get("batch_size", 32)),
            lr=float(hp.get("lr", 0.05)), momentum=float(hp.get("momentum", 0.0)),
            weight_decay=float(hp.get("weight_decay", 1e-3)), grad_clip=float(hp.get("grad_clip", 10.0)),
        )
        rule = algorithm.client(hp, task.broadcast, self.state.section(algorithm.name))
        seed = zlib.crc32(f"{self.device}/{task.round}".encode())
        result = train_locally(model, self.data, rule, settings, seed)
        self._remember_model(release, body)
        ef = self.state.section("codec")  # error feedback: what top-k did not send yet
        encoded = codec.encode(result.delta, task.codec, ef.get("residual"))
        ef["residual"] = encoded.residual
        if encoded.residual is None:
            ef.pop("residual")
        update = messages.Update(self.device, task.round, task.model_version, result.num_samples, result.metrics,
                                 encoded.body, encoded.codec, encoded.specs, self.fed)
        payload = messages.encode_update(update, self.key or b"")
        info = self.client.publish(topics.update(self.fed, self.device), payload, qos=1)
        self.state.data["last_round"] = task.round
        self.state.data["last_model_version"] = task.model_version
        self.state.save()  # once per round: algorithm state, residuals, progress
        info.wait_for_publish(timeout=max(1.0, task.deadline - time.time()))
        log.info("round %d: sent update (%d samples, loss %.4f, %.2f s)", task.round, result.num_samples,
                 result.metrics["train_loss"], result.metrics["train_seconds"])
