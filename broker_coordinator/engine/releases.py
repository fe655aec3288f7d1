"""Model releases: what the coordinator publishes of each version, and which versions exist.

A model version names one model for the federation's lifetime.

The coordinator's state directory counts versions, but the broker outlives it: after a reset of
the state directory (a new run in the same federation) the broker still holds the last run's
retained manifest, and devices hold its model in their caches, under version numbers the new run
would hand out again. So at connect the coordinator reads the retained manifests of the
federation and starts past the newest one (`newest_retained_version`). Intake also checks the
model hash each update reports against the release of the version it names (`intake`), so an
update trained on any other model is rejected with a reason, whatever its number.

The read waits for a condition, not a time: after subscribing, the coordinator publishes a marker
to a topic of its own; the broker delivers the retained manifests of a subscription before any
later message on the same connection, so once the marker is back every retained manifest is in.

With `downlink = "delta"` there are two models (edgefl_protocol/delta_downlink.py):
the engine's weights are the global model G, which the server rule updates; its `broadcast`
holds B, exactly what devices rebuild from lossy deltas, which they train from
and their deltas are relative to. G - B is what the downlink still owes (the
server's error feedback). B is the federation's model: it is evaluated
(`accuracy`/`score`) and served, because every device holds it bit for bit and
because G runs ahead of what devices trained from (in bench/downlink.py G
scored 2-4 points below B). Both are checkpointed (G as `weights`, B with its
deltas under `downlink`); round records add G's score (`global_score`). B
moves towards G once per version, when the engine concludes it (so the checkpoint
holds both and a restart re-derives the same deltas) and, for any other path that
makes a version, in `ModelReleases.publish`.

Sync rounds clear the previous version's retained copies when they publish the next; buffered
versions keep a version retained while a task that names it is out (`keep_older`, `retire`).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from broker_coordinator.engine.rounds import RoundFailed
from edgefl_protocol import OLDEST_SCHEMA, downlink, messages, topics
from edgefl_protocol.transport import Session
from broker_coordinator.engine.transport import Transport
from edgefl_protocol.delta_downlink import Broadcast

log = logging.getLogger("broker_coordinator")
RELEASES_REMEMBERED = 64  # versions whose release hash intake checks updates against


def newest_retained_version(session: Session, fed: str, timeout: float = 60.0, attempt_wait: float = 5.0) -> int | None:
    """The highest version with a retained manifest on the broker (None: none). Raises TimeoutError
    when the broker does not echo the marker in time: starting anyway could reuse a version.

    Each attempt subscribes afresh and sends a new marker: a packet lost to a reconnect (or to
    paho's cross-thread writes) costs one attempt, not the whole timeout."""
    manifests = f"{topics.ROOT}/{fed}/model/+"
    versions: list[int] = []

    def on_manifest(client, userdata, msg) -> None:  # noqa: ANN001 (paho's thread)
        version = msg.topic.rsplit("/", 1)[1]
        if msg.retain and msg.payload and version.isdigit():
            versions.append(int(version))

    client = session.client
    deadline = time.monotonic() + timeout
    answered = False
    client.message_callback_add(manifests, on_manifest)
    try:
        while not answered and time.monotonic() < deadline:
            session.connected.wait(max(0.0, min(attempt_wait, deadline - time.monotonic())))
            marker = f"{topics.ROOT}/{fed}/coordinator/marker/{os.getpid()}-{os.urandom(4).hex()}"
            done = threading.Event()
            client.message_callback_add(marker, lambda c, u, m, done=done: done.set())
            try:
                client.subscribe([(manifests, 1), (marker, 1)])
                client.publish(marker, b"", qos=1)
                answered = done.wait(max(0.0, min(attempt_wait, deadline - time.monotonic())))
            finally:
                client.unsubscribe([manifests, marker])
                client.message_callback_remove(marker)
    finally:
        client.message_callback_remove(manifests)
    if not answered:
        raise TimeoutError(f"the broker did not answer within {timeout:.0f} s while the coordinator read the "
                           "retained model versions; is it overloaded?")
    return max(versions, default=None)


class ModelReleases:
    """What the engine published of each version: the retained payloads of the current one (re-sent
    after a broker restart), the release hash of recent versions (intake checks updates against
    them), and, for a buffered schedule, the older versions tasks still train from."""

    def __init__(self, fed: str, arch: str, fingerprint: str, model_codec: str, chunk_bytes: int,
                 downlink_chain: int, keep_older: bool = False) -> None:
        self.fed, self.arch, self.fingerprint = fed, arch, fingerprint
        self.model_codec, self.chunk_bytes, self.downlink_chain = model_codec, chunk_bytes, downlink_chain
        self.keep_older = keep_older
        # version -> sha256 of its release: intake rejects an update whose reported base is another model
        self.sha: dict[int, str] = {}
        self.payloads: list[tuple[str, bytes]] = []  # retained (topic, payload) of the current model
        self.published: tuple[int, int] | None = None  # (version, chunks) of the retained model
        self.older: dict[int, int] = {}  # keep_older: older versions still retained (version -> chunks)
        self._retained_deltas: set[str] = set()  # delta topics retained on the broker

    def skip_released_versions(self, transport: Session, version: int, resumed: bool) -> int:
        """The first version this run may use: past any version an earlier run left retained
        (`newest_retained_version`)."""
        newest = newest_retained_version(transport, self.fed)
        if newest is None or newest < version or (newest == version and resumed):
            return version
        log.warning("model version %d is retained on the broker from an earlier run of federation %s; this "
                    "run's versions start at %d, so that no version names two models", newest, self.fed, newest + 1)
        # confirmed before going on: a device must never find the old manifest once this run has started
        transport.publish_until(topics.model(self.fed, newest), b"", time.time() + 30, retain=True)
        return newest + 1

    def publish(self, transport: Transport, version: int, tensors: dict[str, np.ndarray],
                broadcast: Broadcast | None, deadline: float) -> None:
        """Once per version: retained chunks, the retained deltas (downlink = "delta"), then the retained
        manifest; clear the previous version (unless tasks still need it) and the deltas that left the
        chain."""
        if self.published and self.published[0] == version:
            return
        chain, deltas = [], []
        if broadcast is not None:  # the full model is B too: exactly what the deltas reconstruct
            tensors = broadcast.advance(tensors, version)
            chain = broadcast.manifest_chain()
            deltas = [(topics.model_delta(self.fed, v), d) for v, d in sorted(broadcast.deltas.items())]
        manifest, chunks = downlink.release(version, self.arch, tensors, self.model_codec, self.chunk_bytes,
                                            self.fingerprint, chain)
        self.sha[version] = manifest.sha256
        for old in sorted(self.sha)[:-RELEASES_REMEMBERED]:
            del self.sha[old]
        self.payloads = [(topics.model_chunk(self.fed, version, i), c) for i, c in enumerate(chunks)]
        self.payloads += deltas + [(topics.model(self.fed, version), messages.encode("model", manifest, OLDEST_SCHEMA))]
        for topic, payload in self.payloads:
            if topic in self._retained_deltas:
                continue  # retained since an earlier version
            if not transport.publish_until(topic, payload, deadline, retain=True):
                raise RoundFailed(f"could not publish model version {version} before the deadline")
        kept = {topic for topic, _ in deltas}
        # after a start, deltas an earlier run left retained are not known: clear the recent versions'
        stale = self._retained_deltas if self.published else {
            topics.model_delta(self.fed, v) for v in range(max(1, version - 2 * self.downlink_chain),
                                                           version + 1)} if broadcast else set()
        for topic in sorted(stale - kept):
            transport.publish(topic, b"", retain=True)
        self._retained_deltas = kept
        if self.published:
            if self.keep_older:  # tasks out may still need it: `retire` clears it
                self.older[self.published[0]] = self.published[1]
            else:
                self.clear(transport, *self.published)
        self.published = (version, len(chunks))

    def retire(self, transport: Transport, current: int, needed: set[int], oldest: int) -> None:
        """Clear the older versions no task out names, and those older than `oldest`."""
        for version, chunks in list(self.older.items()):
            if version != current and (version not in needed or version < oldest):
                del self.older[version]
                self.clear(transport, version, chunks)

    def clear(self, transport: Transport, version: int, chunks: int) -> None:
        """Remove a model version's retained manifest and chunks from the broker."""
        transport.publish(topics.model(self.fed, version), b"", retain=True)
        for i in range(chunks):
            transport.publish(topics.model_chunk(self.fed, version, i), b"", retain=True)
