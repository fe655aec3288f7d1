"""The model the coordinator vouches for, published for the devices to serve (`[serving]`).

After each round that made a version, the coordinator publishes the served average (`publish =
"served"`, the model it evaluates and reports) or the last global model (`"last"`) as a retained
release on `topics.serving`: the manifest and its chunks, in the training model's codec, so that
every device fetches it once and verifies its sha256. With `only_better` a version is published
only when its score (central, or the devices' federated score) is at least the published one's;
`broker-coordinator model promote N` publishes a kept version by hand, whatever its score. What
was published last is kept in `serving.json` in the state directory (`status` shows it), and
published again after a broker restart.

With `downlink = "delta"` (the default, float32 model codec) a release is also a delta from the
release before it, retained on `topics.serving_delta`: a device that holds one of the last
SERVING_CHAIN releases fetches the few deltas since instead of the chunks. The release is then
defined as what the deltas reconstruct (`delta_downlink.Broadcast`: the previous release plus the
4-bit change, the remainder carried to the next one), so that every device holds the same bits and
checks them against the manifest's sha256; the full model retained beside them is that release.
Measured on the headline partition, the release scores within 0.6 points of the served average it
encodes (bench/results/serving.md). A restarted coordinator starts the chain afresh: every device
fetches its next release in full.

A device adds a release to its serving store through its own gate (edge_agent/serving_fetch.py,
serving_gate.py); an agent of 0.1.0 ignores the topic, and one of 0.2.0 fetches the full model.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from broker_coordinator.engine.transport import Transport
from broker_coordinator.settings.serving_settings import ServingSettings
from broker_coordinator.storage.export import find_version, round_score
from broker_coordinator.storage.store import StoreError, read_checkpoint
from edgefl_protocol import OLDEST_SCHEMA, delta_downlink, downlink, messages, topics
from edgefl_protocol.persist import atomic_write

log = logging.getLogger("broker_coordinator")
STATE_FILE = "serving.json"
PROMOTE_FILE = "serving.promote"  # written by `broker-coordinator model promote N`
# 4-bit in chunks of 64 (no top-k): 6.9x smaller than the full model and its accuracy within 0.1 points
# at every release; top-k codecs were 8-30x smaller but up to 0.4-4.4 points off (research/probe_serving,
# docs/RESEARCH.md; bench/results/serving.md measures the shipped one)
SERVING_DELTA_CODEC = "q4c64+zlib"
SERVING_CHAIN = 4  # a device that missed up to 3 releases still fetches deltas (4 are smaller than one model)


def read_published(state_dir: Path | str) -> dict[str, Any] | None:
    """The serving release published last ({version, round, score, metric, weights, published_at, how})."""
    try:
        return json.loads((Path(state_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def request_promote(state_dir: Path | str, version: int) -> Path:
    path = Path(state_dir) / PROMOTE_FILE
    atomic_write(path, f"{version}\n", mode=0o644)
    return path


class ServingReleases:
    def __init__(self, fed: str, arch: str, fingerprint: str, model_codec: str, chunk_bytes: int,
                 settings: ServingSettings, higher_is_better: bool, state_dir: Path | str | None) -> None:
        self.fed, self.arch, self.fingerprint = fed, arch, fingerprint
        self.model_codec, self.chunk_bytes, self.settings = model_codec, chunk_bytes, settings
        self.higher_is_better = higher_is_better
        self.dir = Path(state_dir) if state_dir is not None else None
        self.published = read_published(self.dir) if self.dir else None
        self.payloads: list[tuple[str, bytes]] = []  # retained (topic, payload): sent again after a reconnect
        self.stream: delta_downlink.Broadcast | None = None  # the releases as deltas (downlink = "delta")
        if settings.downlink == "delta" and model_codec != "float32":
            log.info("serving: releases go out in full: deltas need model_codec = \"float32\" (it is %r)",
                     model_codec)

    def after_round(self, transport: Transport, version: int, round_no: int, served: dict[str, np.ndarray],
                    last: dict[str, np.ndarray], score: float | None, metric: str) -> None:
        """The policy after a round that made `version`."""
        if self.settings.publish == "off":
            return
        before = (self.published or {}).get("score")
        if (self.settings.only_better and isinstance(before, (int, float)) and self.published
                and not self._at_least(score, before)):
            log.info("serving: version %d scores %s, the published version %d scored %.4g: kept version %d "
                     "([serving] only_better)", version, "nothing" if score is None else f"{score:.4g}",
                     self.published["version"], before, self.published["version"])
            return
        weights = served if self.settings.publish == "served" else last
        self.publish(transport, version, round_no, weights, score, metric, self.settings.publish)

    def _at_least(self, score: float | None, before: float) -> bool:
        if score is None or not math.isfinite(score):
            return False
        return score >= before if self.higher_is_better else score <= before

    def publish(self, transport: Transport, version: int, round_no: int, weights: dict[str, np.ndarray],
                score: float | None, metric: str, how: str) -> bool:
        """Retained chunks, then the manifest; the previous release's chunks cleared. Never raises for the
        broker: a release that does not go out is logged and tried again after the next round."""
        weights, deltas = self._as_deltas(version, weights)
        manifest, chunks = downlink.release(version, self.arch, weights, self.model_codec, self.chunk_bytes,
                                            self.fingerprint, self.stream.manifest_chain() if deltas else None)
        payloads = [(topics.serving_chunk(self.fed, version, i), c) for i, c in enumerate(chunks)]
        payloads += [(topics.serving_delta(self.fed, v), d) for v, d in deltas.items()]
        payloads.append((topics.serving(self.fed), messages.encode("model", manifest, OLDEST_SCHEMA)))
        for topic, payload in payloads:
            if not transport.publish_until(topic, payload, time.time() + 60, retain=True):
                log.warning("serving: version %d could not be published (the broker did not confirm %s); the "
                            "devices keep serving version %s", version, topic,
                            (self.published or {}).get("version", "none"))
                return False
        before = self.published
        if before and before.get("version") != version:
            for i in range(int(before.get("chunks", 0))):
                transport.publish(topics.serving_chunk(self.fed, int(before["version"]), i), b"", retain=True)
        for old in set(int(v) for v in (before or {}).get("deltas", [])) - set(deltas):  # out of the chain
            transport.publish(topics.serving_delta(self.fed, old), b"", retain=True)
        self.payloads = payloads
        self.published = {"version": version, "round": round_no, "score": score, "metric": metric, "weights": how,
                          "chunks": len(chunks), "sha256": manifest.sha256, "published_at": time.time(),
                          "deltas": sorted(deltas)}
        if self.dir is not None:
            atomic_write(self.dir / STATE_FILE, json.dumps(self.published, indent=1), mode=0o644)
        log.info("serving: published model version %d (round %d, %s%s) for the devices to serve", version,
                 round_no, how, "" if score is None else f", {metric} {score:.4g}")
        return True

    def _as_deltas(self, version: int, weights: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[int, bytes]]:
        """The release's weights (what the deltas reconstruct) and the retained deltas leading to it,
        newest last; the weights as given and no deltas when releases go out in full."""
        if self.settings.downlink != "delta" or self.model_codec != "float32":
            return weights, {}
        if self.stream is None:  # the first release since the coordinator started: in full
            self.stream = delta_downlink.Broadcast(weights, version, SERVING_DELTA_CODEC, SERVING_CHAIN, skips=True)
        released = self.stream.advance(weights, version)
        return released, dict(sorted(self.stream.deltas.items()))

    def promote_if_asked(self, transport: Transport, metric: str) -> None:
        """`broker-coordinator model promote N`: publish kept version N for serving, whatever its score."""
        if self.dir is None or not (path := self.dir / PROMOTE_FILE).exists():
            return
        text = path.read_text().strip()
        path.unlink(missing_ok=True)
        try:
            ckpt = read_checkpoint(find_version(self.dir, int(text)).path)
        except (StoreError, ValueError, KeyError, OSError) as exc:
            log.error("serving: cannot promote model version %s: %s", text, exc)
            return
        score, scored, _ = round_score(ckpt.record)
        self.publish(transport, ckpt.version, ckpt.round, ckpt.served or ckpt.weights, score, scored or metric,
                     "promoted")
