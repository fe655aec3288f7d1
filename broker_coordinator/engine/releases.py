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
`self.weights` is the global model G, which the server rule updates; `self.broadcast`
holds B, exactly what devices rebuild from lossy deltas, which they train from
and their deltas are relative to. G - B is what the downlink still owes (the
server's error feedback). B is the federation's model: it is evaluated
(`accuracy`/`score`) and served, because every device holds it bit for bit and
because G runs ahead of what devices trained from (in bench/downlink.py G
scored 2-4 points below B). Both are checkpointed (G as `weights`, B with its
deltas under `downlink`); round records add G's score (`global_score`). B
moves towards G once per version, in `_conclude` (so the checkpoint holds both
and a restart re-derives the same deltas) and, for any other path that makes a
version, in `_publish_model`.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from broker_coordinator.engine.rounds import RoundFailed
from edgefl_protocol import downlink, messages, topics
from edgefl_protocol.transport import Session

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
    """The coordinator's releases (a mixin of `Coordinator`: it uses its session, settings, model
    and server rule)."""

    def _skip_released_versions(self) -> None:
        """Start past any version an earlier run left retained (`newest_retained_version`)."""
        assert self.session is not None
        newest = newest_retained_version(self.session, self.fed)
        if newest is None or newest < self.version or (newest == self.version and self._resumed):
            return
        log.warning("model version %d is retained on the broker from an earlier run of federation %s; this "
                    "run's versions start at %d, so that no version names two models", newest, self.fed, newest + 1)
        # confirmed before going on: a device must never find the old manifest once this run has started
        self.session.publish_until(topics.model(self.fed, newest), b"", time.time() + 30, retain=True)
        self.version = newest + 1

    def _served_from(self) -> dict[str, np.ndarray]:
        """The federation's model: B with a delta downlink (what every device holds), else G."""
        return self.weights if self.broadcast is None else {n: self.broadcast.tensors[n] for n in self.weights}

    def _release_tensors(self) -> dict[str, np.ndarray]:
        return {**self.weights, **self.server_rule.broadcast_tensors()}  # e.g. FedSMOO's global perturbation

    def _publish_model(self, deadline: float) -> None:
        """Once per version: retained chunks, the retained deltas (downlink = "delta"), then the retained
        manifest; clear the previous version and the deltas that left the chain."""
        assert self.session is not None
        if self._published and self._published[0] == self.version:
            return
        tensors, chain, deltas = self._release_tensors(), [], []
        if self.broadcast is not None:  # the full model is B too: exactly what the deltas reconstruct
            tensors = self.broadcast.advance(tensors, self.version)
            chain = self.broadcast.manifest_chain()
            deltas = [(topics.model_delta(self.fed, v), d) for v, d in sorted(self.broadcast.deltas.items())]
        manifest, chunks = downlink.release(self.version, self.arch, tensors, self.settings.model_codec,
                                            self.settings.model_chunk_bytes, self.fingerprint, chain)
        self.released_sha[self.version] = manifest.sha256
        for old in sorted(self.released_sha)[:-RELEASES_REMEMBERED]:
            del self.released_sha[old]
        self._model_payloads = [(topics.model_chunk(self.fed, self.version, i), c) for i, c in enumerate(chunks)]
        self._model_payloads += deltas + [(topics.model(self.fed, self.version), messages.encode("model", manifest))]
        for topic, payload in self._model_payloads:
            if topic in self._retained_deltas:
                continue  # retained since an earlier version
            if not self.session.publish_until(topic, payload, deadline, retain=True):
                raise RoundFailed(f"could not publish model version {self.version} before the deadline")
        kept = {topic for topic, _ in deltas}
        # after a start, deltas an earlier run left retained are not known: clear the recent versions'
        stale = self._retained_deltas if self._published else {
            topics.model_delta(self.fed, v) for v in range(max(1, self.version - 2 * self.settings.downlink_chain),
                                                           self.version + 1)} if self.broadcast else set()
        for topic in sorted(stale - kept):
            self.session.publish(topic, b"", qos=1, retain=True)
        self._retained_deltas = kept
        if self._published:  # clear the previous version's retained copies
            self._clear_release(*self._published)
        self._published = (self.version, len(chunks))

    def _clear_release(self, version: int, chunks: int) -> None:
        """Remove a model version's retained manifest and chunks from the broker."""
        assert self.session is not None
        self.session.publish(topics.model(self.fed, version), b"", qos=1, retain=True)
        for i in range(chunks):
            self.session.publish(topics.model_chunk(self.fed, version, i), b"", qos=1, retain=True)
