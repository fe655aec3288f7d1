"""The serving release: the model the coordinator vouches for, fetched for the serving store.

The coordinator publishes it retained on `topics.serving` (a manifest), its chunks and, where it
sends deltas, the deltas from the releases before it (broker_coordinator/engine/serving.py). paho's
thread calls `on_message`: a manifest newer than what the device serves starts a fetch. A device
that holds a release the manifest chains from (the last one it fetched, kept in memory) subscribes
to the few deltas since and checks every step's sha256 (`edgefl_protocol.delta_downlink`); any other
subscribes to the chunks until the body is whole and its sha256 checked. The body then waits in
`ready` for the agent's main thread, which scores it through the gate between tasks. A manifest,
chunk or delta that does not check out is dropped with its reason (a delta: the full model is
fetched instead), and the current version keeps serving.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter

from edgefl_protocol import delta_downlink, downlink, messages, topics
from edgefl_protocol.errors import Rejected

log = logging.getLogger("edge_agent")
MAX_MANIFEST_BYTES = 1 << 20
MAX_DELTA_BYTES = 64 * 1024 * 1024
MAX_VALUES = 16 * 1024 * 1024


class ServingFetch:
    def __init__(self, fed: str, newest: int | None) -> None:
        self.fed = fed
        self.newest = newest  # the newest version served or fetched: older manifests are ignored
        self.seen = False  # the coordinator publishes serving releases: the training releases are not served
        self.assembly: downlink.Assembly | None = None
        self.chain: delta_downlink.Chain | None = None
        self.held: tuple[str, bytes] | None = None  # (sha256, float32 body) of the last release fetched
        self.ready: tuple[messages.ModelRelease, bytes] | None = None
        self.received: Counter[str] = Counter()  # bytes received: manifest, full (chunks), delta
        self.fetched: Counter[str] = Counter()  # releases fetched: in full, by delta
        self.lock = threading.Lock()

    def subscriptions(self) -> list[tuple[str, int]]:
        """The chunks or deltas of a fetch under way (subscribed again on reconnect; the manifest comes
        with model/+)."""
        a, c = self.assembly, self.chain
        return ([(topics.serving_chunks(self.fed, a.manifest.version), 1)] if a is not None else []) \
            + ([(topics.serving_delta(self.fed, v), 1) for v in c.versions] if c is not None else [])

    def owns(self, topic: str) -> bool:
        return (topic == topics.serving(self.fed) or topics.parse_serving_chunk_topic(topic) is not None
                or topics.parse_serving_delta_topic(topic) is not None)

    def on_message(self, client, topic: str, payload: bytes) -> None:  # noqa: ANN001 (paho's thread)
        if not payload:
            return
        if topic == topics.serving(self.fed):
            self._count("manifest", payload)
            self._on_manifest(client, messages.decode_model(payload, MAX_MANIFEST_BYTES))
        elif (version := topics.parse_serving_delta_topic(topic)) is not None:
            self._count("delta", payload)
            self._on_delta(client, version, payload)
        elif (where := topics.parse_serving_chunk_topic(topic)) is not None:
            self._count("full", payload)
            self._on_chunk(client, *where, payload)

    def _count(self, way: str, payload: bytes) -> None:
        with self.lock:
            self.received[way] += len(payload)

    def _on_manifest(self, client, release: messages.ModelRelease) -> None:  # noqa: ANN001
        with self.lock:
            self.seen = True
            if self.newest is not None and release.version <= self.newest:
                return
            self._drop_fetch(client)
            self.newest = release.version
            plan = delta_downlink.plan(release, dict([self.held])) if self.held else None
            if plan is None:
                self.assembly = downlink.Assembly(release)
            else:
                self.chain = delta_downlink.Chain(release, *plan)
        if plan is None:
            client.subscribe(topics.serving_chunks(self.fed, release.version), qos=1)
        else:
            client.subscribe([(topics.serving_delta(self.fed, v), 1) for v in self.chain.versions])

    def _drop_fetch(self, client) -> None:  # noqa: ANN001 - a fetch overtaken by a newer release
        if self.assembly is not None:
            client.unsubscribe(topics.serving_chunks(self.fed, self.assembly.manifest.version))
        if self.chain is not None:
            self._unsubscribe(client, self.chain)
        self.assembly = self.chain = None

    def _unsubscribe(self, client, chain: delta_downlink.Chain) -> None:  # noqa: ANN001
        client.unsubscribe([topics.serving_delta(self.fed, v) for v in chain.versions])

    def _on_chunk(self, client, version: int, index: int, payload: bytes) -> None:  # noqa: ANN001
        with self.lock:
            a = self.assembly
            if a is None or version != a.manifest.version:
                return
            a.add(index, payload)
            if not a.complete:
                return
            self.assembly = None
        client.unsubscribe(topics.serving_chunks(self.fed, a.manifest.version))
        try:
            body = a.body()  # raises Rejected("integrity") on a sha256 mismatch
        except Rejected:
            with self.lock:
                self.newest = None if self.newest == a.manifest.version else self.newest  # fetch it again
            raise
        self._arrived(a.manifest, body, "full", "in full")

    def _on_delta(self, client, version: int, payload: bytes) -> None:  # noqa: ANN001
        with self.lock:
            c = self.chain
            if c is None or version not in c.versions:
                return  # a retained delta we do not need
        try:
            delta = messages.decode_delta(payload, MAX_DELTA_BYTES)
            if delta.version != version:
                raise Rejected("schema", f"serving delta topic says version {version}, message says {delta.version}")
            with self.lock:
                c.add(delta)
                if not c.complete:
                    return
                self.chain = None
            body = c.body(MAX_VALUES)  # every step's sha256 checked, or Rejected
        except Rejected as exc:  # never serve what the coordinator does not hold: fetch it in full
            with self.lock:
                if self.chain is c:
                    self.chain = None
                refetch = self.assembly is None and self.newest == c.manifest.version  # not overtaken since
                if refetch:
                    self.assembly = downlink.Assembly(c.manifest)
            self._unsubscribe(client, c)
            if refetch:
                client.subscribe(topics.serving_chunks(self.fed, c.manifest.version), qos=1)
            raise Rejected(exc.reason, f"{exc.detail}; fetching serving release {c.manifest.version} in full") \
                from None
        self._unsubscribe(client, c)
        self._arrived(c.manifest, body, "delta", f"as {len(c.versions)} delta(s) from the release it held")

    def _arrived(self, release: messages.ModelRelease, body: bytes, way: str, how: str) -> None:
        log.info("serving release %d fetched %s", release.version, how)
        with self.lock:
            self.ready = (release, body)
            self.fetched[way] += 1
            if release.codec == "float32":  # what the next release's deltas may apply to (a chain needs float32)
                self.held = (hashlib.sha256(body).hexdigest(), body)

    def counts(self) -> dict[str, dict[str, int]]:
        """What serving has cost this device since it started: bytes by message kind, releases by way."""
        with self.lock:
            return {"bytes": dict(self.received), "releases": dict(self.fetched)}

    def take(self) -> tuple[messages.ModelRelease, bytes] | None:
        with self.lock:
            ready, self.ready = self.ready, None
        return ready
