"""A model version names one model for the federation's lifetime.

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
"""

from __future__ import annotations

import os
import threading

from edgefl_protocol import topics
from edgefl_protocol.transport import Session


def newest_retained_version(session: Session, fed: str, timeout: float = 10.0) -> int | None:
    """The highest version with a retained manifest on the broker (None: none, or no answer in time)."""
    manifests = f"{topics.ROOT}/{fed}/model/+"
    marker = f"{topics.ROOT}/{fed}/coordinator/marker/{os.getpid()}-{os.urandom(4).hex()}"
    versions: list[int] = []
    done = threading.Event()

    def on_manifest(client, userdata, msg) -> None:  # noqa: ANN001 (paho's thread)
        version = msg.topic.rsplit("/", 1)[1]
        if msg.retain and msg.payload and version.isdigit():
            versions.append(int(version))

    client = session.client
    client.message_callback_add(manifests, on_manifest)
    client.message_callback_add(marker, lambda c, u, m: done.set())
    try:
        client.subscribe([(manifests, 1), (marker, 1)])
        client.publish(marker, b"", qos=1)
        answered = done.wait(timeout)
    finally:
        client.unsubscribe([manifests, marker])
        client.message_callback_remove(manifests)
        client.message_callback_remove(marker)
    if not answered:
        return None
    return max(versions, default=None)
