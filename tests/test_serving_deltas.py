"""Serving releases as deltas ([serving] downlink = "delta"): a device holding a recent release
fetches the change, not the model, and holds the very bits every other device holds."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from broker_coordinator.engine.serving import SERVING_CHAIN
from broker_coordinator.simulation.in_memory import fold_round
from edge_agent.serving_fetch import ServingFetch
from edgefl_protocol import delta_downlink, downlink, messages, topics
from edgefl_protocol.errors import Rejected

from .test_serving_releases import FED, answers, engine, retained_release


class Client:
    """What ServingFetch asks of paho's client: its subscriptions, recorded."""

    def __init__(self) -> None:
        self.subscribed: set[str] = set()

    def subscribe(self, topic, qos: int = 0) -> None:  # noqa: ANN001 - a topic or [(topic, qos)]
        self.subscribed |= {t for t, _ in topic} if isinstance(topic, list) else {topic}

    def unsubscribe(self, topic) -> None:  # noqa: ANN001
        self.subscribed -= set(topic) if isinstance(topic, list) else {topic}


def deliver(fetch: ServingFetch, client: Client, retained: dict[str, bytes]) -> None:
    """The broker's side: the manifest, then every retained message on a topic the device subscribed
    to, until it subscribes to nothing new."""
    fetch.on_message(client, topics.serving(FED), retained[topics.serving(FED)])
    delivered: set[str] = set()
    while True:
        pending = [t for t in sorted(retained) if t not in delivered and any(
            t == s or (s.endswith("/+") and t.rsplit("/", 1)[0] == s[:-2]) for s in client.subscribed)]
        if not pending:
            return
        for topic in pending:
            delivered.add(topic)
            fetch.on_message(client, topic, retained[topic])


def test_a_device_holding_the_last_release_fetches_only_the_change_and_holds_the_same_bits(tmp_path):
    e = engine(tmp_path, only_better=False)
    fetch, client = ServingFetch(FED, None), Client()
    fold_round(e, answers(e, 1.0, seed=1), 1)
    deliver(fetch, client, e.transport.retained)
    first = fetch.take()
    assert first is not None and first[0].version == 1 and fetch.received["delta"] == 0  # new: in full
    full_bytes = fetch.received["full"]
    for round_no in (2, 3):
        before_weights = retained_release(e)[1]
        fold_round(e, answers(e, 1.0, seed=round_no), round_no)
        before = fetch.received["full"]
        deliver(fetch, client, e.transport.retained)
        release, body = fetch.take()
        assert release.version == round_no and fetch.received["full"] == before  # no chunk fetched
        manifest, weights = retained_release(e)  # what a new device fetches in full
        assert hashlib.sha256(body).hexdigest() == manifest.sha256 == e.serving.stream.sha256
        # the release is the served average up to the 4-bit rounding of the change
        off = lambda w: np.sqrt(sum(float(((w[n] - e.served.weights[n]) ** 2).sum()) for n in w))  # noqa: E731
        assert off(weights) < 0.15 * off(before_weights), (off(weights), off(before_weights))
    assert 0 < fetch.received["delta"] < full_bytes / 2  # two deltas cost less than one model
    assert not client.subscribed  # nothing left subscribed between releases


def test_the_chain_skips_versions_not_published_and_keeps_the_last_few_deltas(tmp_path):
    """`only_better` publishes some versions only: a delta leads from one release to the next whatever
    versions lie between; the broker keeps the last SERVING_CHAIN deltas, and a device that missed
    releases within them still fetches deltas."""
    e = engine(tmp_path, only_better=False)
    fold_round(e, answers(e, 1.0, seed=1), 1)
    behind = ServingFetch(FED, None)
    deliver(behind, Client(), e.transport.retained)
    release_1 = behind.take()
    assert release_1[0].version == 1
    e.serving.settings.publish = "off"
    fold_round(e, answers(e, 1.0, seed=2), 2)  # version 2: not published
    e.serving.settings.publish = "served"
    for round_no in range(3, 3 + SERVING_CHAIN):
        fold_round(e, answers(e, 1.0, seed=round_no), round_no)
    manifest = messages.decode_model(e.transport.retained[topics.serving(FED)], 1 << 20)
    assert [v for v, _ in manifest.chain] == list(range(3, 3 + SERVING_CHAIN))  # 2 skipped, 1's delta none
    deltas = sorted(t for t in e.transport.retained if topics.parse_serving_delta_topic(t) is not None)
    assert deltas == [topics.serving_delta(FED, v) for v in range(3, 3 + SERVING_CHAIN)]
    client = Client()
    deliver(behind, client, e.transport.retained)  # held release 1: the first delta applies to it
    release, body = behind.take()
    assert release.version == manifest.version and hashlib.sha256(body).hexdigest() == manifest.sha256
    assert behind.received["full"] > 0 and behind.received["delta"] > 0
    fold_round(e, answers(e, 1.0, seed=9), 3 + SERVING_CHAIN)  # one more: release 1 falls out of the chain
    newest = messages.decode_model(e.transport.retained[topics.serving(FED)], 1 << 20)
    assert delta_downlink.plan(newest, {release_1[0].sha256: release_1[1]}) is None  # in full, then
    assert topics.serving_delta(FED, 3) not in e.transport.retained


def test_a_corrupted_delta_is_refused_and_the_full_release_fetched_instead(tmp_path):
    e = engine(tmp_path, only_better=False)
    fetch = ServingFetch(FED, None)
    fold_round(e, answers(e, 1.0, seed=1), 1)
    deliver(fetch, Client(), e.transport.retained)
    fetch.take()
    fold_round(e, answers(e, 1.0, seed=2), 2)
    retained = dict(e.transport.retained)
    delta = messages.decode_delta(retained[topics.serving_delta(FED, 2)], 1 << 26)
    delta.body = bytes(b ^ 0x55 for b in delta.body[:64]) + delta.body[64:]
    retained[topics.serving_delta(FED, 2)] = messages.encode("delta", delta)
    client = Client()
    fetch.on_message(client, topics.serving(FED), retained[topics.serving(FED)])
    assert client.subscribed == {topics.serving_delta(FED, 2)}
    with pytest.raises(Rejected, match="fetching serving release 2 in full"):
        fetch.on_message(client, topics.serving_delta(FED, 2), retained[topics.serving_delta(FED, 2)])
    assert client.subscribed == {topics.serving_chunks(FED, 2)} and fetch.take() is None
    manifest = messages.decode_model(retained[topics.serving(FED)], 1 << 20)
    for i in range(manifest.chunks):
        fetch.on_message(client, topics.serving_chunk(FED, 2, i), retained[topics.serving_chunk(FED, 2, i)])
    release, body = fetch.take()
    assert release.version == 2 and hashlib.sha256(body).hexdigest() == manifest.sha256


def test_full_releases_when_asked_or_when_the_model_codec_is_not_float32(tmp_path, caplog):
    e = engine(tmp_path / "full", only_better=False, downlink="full")
    for round_no in (1, 2):
        fold_round(e, answers(e, 1.0, seed=round_no), round_no)
    manifest, weights = retained_release(e)
    assert manifest.chain == [] and not any(topics.parse_serving_delta_topic(t) for t in e.transport.retained)
    for name, served in e.served.weights.items():  # in full: the served average itself
        np.testing.assert_array_equal(weights[name], served)
    with caplog.at_level(logging.INFO, logger="broker_coordinator"):
        half = engine(tmp_path / "half", only_better=False)
        from broker_coordinator.engine.serving import ServingReleases
        ServingReleases(FED, "digits_mlp", "", "float16", downlink.DEFAULT_CHUNK_BYTES, half.serving.settings,
                        True, None)
    assert 'releases go out in full: deltas need model_codec = "float32"' in caplog.text


def test_the_serving_downlink_setting_is_checked():
    from broker_coordinator.settings.serving_settings import ServingSettings
    with pytest.raises(ValueError, match="downlink must be one of delta, full"):
        ServingSettings(downlink="xor").validate()


def test_a_promoted_version_and_a_restarted_coordinator_start_the_chain_afresh(tmp_path):
    """A version promoted by hand, or the first release after a restart, goes out in full with no
    chain, and the deltas retained for the chain before it are cleared from the broker."""
    from broker_coordinator.engine.serving import ServingReleases, read_published, request_promote
    e = engine(tmp_path, only_better=False)
    for round_no in (1, 2, 3):
        fold_round(e, answers(e, 1.0, seed=round_no), round_no)
    assert read_published(tmp_path)["deltas"] == [2, 3]
    request_promote(tmp_path, 1)
    e.idle(0.0)
    manifest, weights = retained_release(e)
    assert manifest.version == 1 and manifest.chain == []
    assert not [t for t in e.transport.retained if topics.parse_serving_delta_topic(t) is not None]
    assert read_published(tmp_path)["weights"] == "promoted" and read_published(tmp_path)["deltas"] == []
    fold_round(e, answers(e, 1.0, seed=4), 4)  # the chain goes on from the promoted release
    assert [v for v, _ in retained_release(e)[0].chain] == [4]
    # a restarted coordinator: its first release in full, the last run's deltas cleared
    restarted = ServingReleases(FED, e.arch, e.releases.fingerprint, "float32", downlink.DEFAULT_CHUNK_BYTES,
                                e.serving.settings, True, tmp_path)
    restarted.publish(e.transport, 5, 5, e.served.weights, None, "accuracy", "served")
    manifest = messages.decode_model(e.transport.retained[topics.serving(FED)], 1 << 20)
    assert manifest.version == 5 and manifest.chain == []
    assert topics.serving_delta(FED, 4) not in e.transport.retained
