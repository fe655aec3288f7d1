"""The serving release: the model the coordinator vouches for, fetched for the serving store.

The coordinator publishes it retained on `topics.serving` (a manifest) and its chunks beside it
(broker_coordinator/engine/serving.py). paho's thread calls `on_message`: a manifest newer than
what the device serves starts a fetch (the chunks' topic is subscribed until the body is whole and
its sha256 checked); the body then waits in `ready` for the agent's main thread, which scores it
through the gate between tasks. A manifest or chunk that does not check out is dropped with its
reason, and the current version keeps serving.
"""

from __future__ import annotations

import logging
import threading

from edgefl_protocol import downlink, messages, topics
from edgefl_protocol.errors import Rejected

log = logging.getLogger("edge_agent")
MAX_MANIFEST_BYTES = 1 << 20


class ServingFetch:
    def __init__(self, fed: str, newest: int | None) -> None:
        self.fed = fed
        self.newest = newest  # the newest version served or fetched: older manifests are ignored
        self.seen = False  # the coordinator publishes serving releases: the training releases are not served
        self.assembly: downlink.Assembly | None = None
        self.ready: tuple[messages.ModelRelease, bytes] | None = None
        self.lock = threading.Lock()

    def subscriptions(self) -> list[tuple[str, int]]:
        """The chunks of a fetch under way (subscribed again on reconnect; the manifest comes with model/+)."""
        a = self.assembly
        return [(topics.serving_chunks(self.fed, a.manifest.version), 1)] if a is not None else []

    def owns(self, topic: str) -> bool:
        return topic == topics.serving(self.fed) or topics.parse_serving_chunk_topic(topic) is not None

    def on_message(self, client, topic: str, payload: bytes) -> None:  # noqa: ANN001 (paho's thread)
        if not payload:
            return
        if topic == topics.serving(self.fed):
            release = messages.decode_model(payload, MAX_MANIFEST_BYTES)
            with self.lock:
                self.seen = True
                if self.newest is not None and release.version <= self.newest:
                    return
                self.assembly, self.newest = downlink.Assembly(release), release.version
            client.subscribe(topics.serving_chunks(self.fed, release.version), qos=1)
            return
        where = topics.parse_serving_chunk_topic(topic)
        with self.lock:
            a = self.assembly
            if where is None or a is None or where[0] != a.manifest.version:
                return
            a.add(where[1], payload)
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
        with self.lock:
            self.ready = (a.manifest, body)

    def take(self) -> tuple[messages.ModelRelease, bytes] | None:
        with self.lock:
            ready, self.ready = self.ready, None
        return ready
