"""How the global model reaches the device: a part of `Agent` (paho's thread calls `on_message`).

A version arrives as a retained manifest. The agent already holding those
bytes (sha256, in memory or `model.bin` in the state dir) fetches nothing; one
holding a version the manifest chains from fetches the compressed deltas
since (`edgefl_protocol.delta_downlink`, every step's sha256 checked); any
other fetches the full model's chunks and checks their sha256. A delta it
cannot use falls back to the full model: the agent never trains on a model the
server does not hold. Bytes received are counted and reported with the next
accepted update.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from pathlib import Path

from edgefl_protocol import delta_downlink, downlink, messages, topics
from edgefl_protocol.errors import Rejected

from .state import DeviceState, atomic_write

log = logging.getLogger("edge_agent")
MAX_MODEL_BYTES = 64 * 1024 * 1024
MAX_MODEL_VALUES = 16 * 1024 * 1024
MODEL_CACHE = "model.bin"
DOWN_COUNTERS = ("bytes_down", "bytes_down_join")


class ModelFetch:
    """The model versions this device holds or is fetching, for federation `fed`. `state` keeps the
    downlink byte counts, `cache_dir` the newest model's bytes; `stopping` ends a wait for a model."""

    def __init__(self, fed: str, state: DeviceState, cache_dir: Path, stopping: threading.Event) -> None:
        self.fed, self.state, self.cache_dir, self.stopping = fed, state, Path(cache_dir), stopping
        self.models: dict[int, tuple[messages.ModelRelease, bytes]] = {}  # version -> manifest, verified body
        self.assemblies: dict[int, downlink.Assembly] = {}  # versions being fetched
        self.chains: dict[int, delta_downlink.Chain] = {}  # versions being reconstructed from deltas
        self.downlink_rejected: Counter[str] = Counter()  # model messages ignored, by reason
        self.arrived_via: dict[int, str] = {}  # version -> how the model got here: cache, full or delta
        self.cached: tuple[str, bytes] | None = self._load_cached_model()  # (sha256, body)
        self.models_changed = threading.Condition()
        # model bytes received (manifests, chunks, deltas) not yet reported with an accepted update;
        # "_join": received while the device held no model at all (its first download)
        for key in DOWN_COUNTERS:
            state.data.setdefault(key, 0)

    def subscriptions(self) -> list[tuple[str, int]]:
        """The chunk and delta topics of the fetches under way (subscribed again on reconnect)."""
        return ([(topics.model_chunks(self.fed, v), 1) for v in list(self.assemblies)]
                + [(topics.model_delta(self.fed, v), 1) for c in list(self.chains.values()) for v in c.versions])

    def on_message(self, client, topic: str, payload: bytes) -> None:  # noqa: ANN001
        """A manifest, chunk or delta (other topics are not ours); a message it ignores is counted by
        reason in `downlink_rejected` and raised (Rejected) for the caller's log."""
        try:
            if (version := topics.parse_model_topic(topic)) is not None and payload:
                self.count_down(payload)
                release = messages.decode_model(payload, MAX_MODEL_BYTES)
                if release.version != version:
                    raise Rejected("schema", f"model topic says version {version}, message says {release.version}")
                self.on_manifest(client, release)
            elif (where := topics.parse_model_chunk_topic(topic)) is not None and payload:
                self.count_down(payload)
                self.on_chunk(client, *where, payload)
            elif (version := topics.parse_model_delta_topic(topic)) is not None and payload:
                self.count_down(payload)
                self.on_delta(client, version, payload)
        except Rejected as exc:
            if topic.split("/")[2:3] == ["model"]:
                self.downlink_rejected[exc.reason] += 1
            raise

    def on_manifest(self, client, release: messages.ModelRelease) -> None:  # noqa: ANN001
        with self.models_changed:
            if release.version in self.models or release.version in self.assemblies or release.version in self.chains:
                return
            if self.cached and self.cached[0] == release.sha256:  # already have these bytes: no fetch
                self._ready(release, self.cached[1], "cache")
                return
            held = {m.sha256: body for m, body in self.models.values()}
            if self.cached:
                held[self.cached[0]] = self.cached[1]
            plan = delta_downlink.plan(release, held)
            if plan is None:  # new, too far behind, or a model the server no longer chains from
                self.assemblies[release.version] = downlink.Assembly(release)
            else:
                self.chains[release.version] = delta_downlink.Chain(release, *plan)
        if plan is None:
            client.subscribe(topics.model_chunks(self.fed, release.version), qos=1)
        else:
            client.subscribe([(topics.model_delta(self.fed, v), 1) for v in self.chains[release.version].versions])

    def count_down(self, payload: bytes) -> None:
        with self.models_changed:
            key = DOWN_COUNTERS[0] if self.models or self.cached else DOWN_COUNTERS[1]
            self.state.data[key] = int(self.state.data.get(key, 0)) + len(payload)

    def take_down_counts(self) -> dict[str, int]:
        """The model bytes received since the last accepted update (reported with the next one)."""
        with self.models_changed:
            counts = {key: int(self.state.data.get(key, 0)) for key in DOWN_COUNTERS}
            self.state.data.update({key: 0 for key in DOWN_COUNTERS})
        return {key: n for key, n in counts.items() if n or key == DOWN_COUNTERS[0]}

    def give_back_down_counts(self, counts: dict[str, int]) -> None:
        with self.models_changed:
            for key, n in counts.items():
                self.state.data[key] = int(self.state.data.get(key, 0)) + n

    def on_delta(self, client, version: int, payload: bytes) -> None:  # noqa: ANN001
        with self.models_changed:  # usually one chain; two when a manifest came before the last chain ended
            chains = [c for c in self.chains.values() if version in c.versions]
        if not chains:
            return  # a retained delta we no longer need
        try:
            delta = messages.decode_delta(payload, MAX_MODEL_BYTES)
            if delta.version != version:
                raise Rejected("schema", f"delta topic says version {version}, message says {delta.version}")
        except Rejected as exc:
            for chain in chains:
                self._fetch_full(client, chain, exc)
            return
        for chain in chains:
            try:
                with self.models_changed:
                    chain.add(delta)
                    if not chain.complete:
                        continue
                body = chain.body(MAX_MODEL_VALUES)  # every step's sha256 checked, or Rejected
            except Rejected as exc:
                self._fetch_full(client, chain, exc)
                continue
            with self.models_changed:
                if self.chains.pop(chain.manifest.version, None) is not None:
                    self._ready(chain.manifest, body, "delta")
            self._unsubscribe_deltas(client, chain)

    def _unsubscribe_deltas(self, client, chain: delta_downlink.Chain) -> None:  # noqa: ANN001
        with self.models_changed:
            needed = {v for c in self.chains.values() for v in c.versions}
        client.unsubscribe([topics.model_delta(self.fed, v) for v in chain.versions if v not in needed])

    def _fetch_full(self, client, chain: delta_downlink.Chain, why: Rejected) -> None:  # noqa: ANN001
        """A delta we cannot use: never train on a model the server does not hold; fetch the full one."""
        self.downlink_rejected[why.reason] += 1
        with self.models_changed:
            if self.chains.pop(chain.manifest.version, None) is None:
                return  # already given up on
            self.assemblies[chain.manifest.version] = downlink.Assembly(chain.manifest)
        log.warning("model version %d: cannot use the deltas from version %d (%s: %s); fetching the full model",
                    chain.manifest.version, chain.first - 1, why.reason, why.detail)
        self._unsubscribe_deltas(client, chain)
        client.subscribe(topics.model_chunks(self.fed, chain.manifest.version), qos=1)

    def on_chunk(self, client, version: int, index: int, data: bytes) -> None:  # noqa: ANN001
        with self.models_changed:
            assembly = self.assemblies.get(version)
            if assembly is None:
                return
            assembly.add(index, data)
            if not assembly.complete:
                return
            del self.assemblies[version]
        client.unsubscribe(topics.model_chunks(self.fed, version))
        try:
            body = assembly.body()  # sha256 verified, or Rejected
        except Rejected:
            with self.models_changed:  # fetch again: subscribing delivers the retained chunks anew
                self.assemblies[version] = downlink.Assembly(assembly.manifest)
            client.subscribe(topics.model_chunks(self.fed, version), qos=1)
            raise
        with self.models_changed:
            self._ready(assembly.manifest, body, "full")

    def _ready(self, release: messages.ModelRelease, body: bytes, via: str) -> None:
        """Caller holds models_changed. `via`: cache, full or delta (reported with the update)."""
        self.models = {v: m for v, m in self.models.items() if v > release.version - 2}
        self.models[release.version] = (release, body)
        self.arrived_via = {v: how for v, how in self.arrived_via.items() if v in self.models}
        self.arrived_via[release.version] = via
        self.models_changed.notify_all()

    def _load_cached_model(self) -> tuple[str, bytes] | None:
        try:
            body = (self.cache_dir / MODEL_CACHE).read_bytes()
        except OSError:
            return None
        return hashlib.sha256(body).hexdigest(), body

    def remember_model(self, release: messages.ModelRelease, body: bytes) -> None:
        """Keep the newest model's bytes (memory and disk) so a reconnect or restart does not fetch it again."""
        if self.cached and self.cached[0] == release.sha256:
            return
        self.cached = (release.sha256, body)
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.cache_dir / MODEL_CACHE, body)
        except OSError as exc:
            log.warning("cannot cache the model on disk: %s", exc)

    def wait_for_model(self, version: int, deadline: float) -> tuple[messages.ModelRelease, bytes] | None:
        with self.models_changed:
            while version not in self.models:
                remaining = deadline - time.time()
                if remaining <= 0 or self.stopping.is_set():
                    return None
                self.models_changed.wait(min(remaining, 0.5))
            return self.models[version]
