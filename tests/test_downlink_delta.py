"""The delta downlink (edgefl_protocol/delta_downlink.py): devices reconstruct the server's
broadcast model bit for bit from lossy deltas, or fetch the full model when they cannot."""

import json
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.storage.store import Checkpoint, Store, model_sha256
from edge_agent.agent import Agent
from edge_agent.config import load_config
from edgefl_protocol import delta_downlink as dd
from edgefl_protocol import downlink, messages, signing, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.persist import unpack
from edgefl_models import datasets
from edgefl_models.architectures import build_model, get_weights

MAX_VALUES = 1_000_000


def walk(weights, steps, seed=0, extras=False):
    """A global model moving as rounds would move it (and, optionally, a server-rule tensor)."""
    rng = np.random.default_rng(seed)
    g = dict(weights)
    for _ in range(steps):
        g = {n: (a + rng.normal(0, 0.02, a.shape)).astype(np.float32) for n, a in g.items()
             if not n.startswith("extra.")}
        if extras:
            g["extra.s.w"] = rng.normal(0, 1, (7, 3)).astype(np.float32)
        yield g


def release(broadcast: dd.Broadcast, version: int) -> tuple[messages.ModelRelease, bytes]:
    manifest, chunks = downlink.release(version, "digits_mlp", broadcast.tensors, "float32",
                                        chain=broadcast.manifest_chain())
    return messages.decode_model(messages.encode("model", manifest), 10**8), b"".join(chunks)


def reconstruct(manifest, held, deltas):
    chain = dd.Chain(manifest, *dd.plan(manifest, held))
    for v in chain.versions:
        chain.add(messages.decode_delta(deltas[v], 10**8))
    return chain.body(MAX_VALUES)


@pytest.mark.parametrize("extras", [False, True])
def test_devices_reconstruct_the_broadcast_model_bit_for_bit_over_many_versions(extras):
    weights = get_weights(build_model("digits_mlp", 0))
    server = dd.Broadcast(weights, 0, "topk0.05+q4c64+zlib", chain=4)
    _, body = release(server, 0)
    every_round = {server.sha256: body}  # a device selected or following every version
    every_third = dict(every_round)  # a device that wakes up every third version
    for version, g in enumerate(walk(weights, 30, extras=extras), start=1):
        server.advance(g, version)
        manifest, full = release(server, version)
        assert manifest.sha256 == server.sha256 == dd.tensors_sha256(server.tensors)
        got = reconstruct(manifest, every_round, server.deltas)
        assert got == full  # the very bytes of the full model: bit-identical weights
        every_round = {manifest.sha256: got}
        if version % 3 == 0:
            assert dd.plan(manifest, every_third)[0] == version - 2  # a chain of three deltas
            every_third = {manifest.sha256: reconstruct(manifest, every_third, server.deltas)}
            assert every_third[manifest.sha256] == full
    if extras:  # the server rule's tensors arrive whole, not approximated
        decoded = downlink.decode_weights(manifest, full, None, MAX_VALUES)
        assert np.array_equal(decoded["extra.s.w"], g["extra.s.w"])
    # the server's error feedback: B trails G by what the downlink still owes, not by a drift
    owed = np.sqrt(sum(np.sum((g[n] - server.tensors[n]) ** 2) for n in weights))
    moved = np.sqrt(sum(np.sum((g[n] - weights[n]) ** 2) for n in weights))
    assert owed < 0.5 * moved
    assert len(server.deltas) == 4 and min(server.deltas) == 27  # only the last `chain` are kept


def test_too_far_behind_new_or_unknown_model_gets_no_chain():
    weights = get_weights(build_model("digits_mlp", 0))
    server = dd.Broadcast(weights, 0, chain=3)
    _, v0 = release(server, 0)
    for version, g in enumerate(walk(weights, 5), start=1):
        server.advance(g, version)
    manifest, _ = release(server, 5)
    assert dd.plan(manifest, {dd.tensors_sha256(weights): v0}) is None  # 5 behind, chain 3
    assert dd.plan(manifest, {}) is None  # new
    assert dd.plan(manifest, {"0" * 64: b"x"}) is None  # a model the server never broadcast
    assert server.advance(weights, 9) is server.tensors and server.deltas == {}  # a gap starts afresh


def test_restarted_server_rederives_the_same_delta_from_its_checkpoint(tmp_path):
    weights = get_weights(build_model("digits_mlp", 0))
    server = dd.Broadcast(weights, 0, chain=4)
    steps = list(walk(weights, 6))
    for version, g in enumerate(steps[:5], start=1):
        server.advance(g, version)
    # the checkpoint of the round that made G_6 holds B_5 (published at that round's start)
    Store(tmp_path).save_checkpoint(Checkpoint(6, 6, "digits_mlp", steps[5], model_sha256(steps[5]), {}, {},
                                     downlink=server.state()))
    ckpt = Store(tmp_path).load_checkpoint()
    restarted = dd.Broadcast(ckpt.weights, ckpt.version, chain=4)
    assert restarted.load(ckpt.downlink, ckpt.version)
    server.advance(steps[5], 6)
    restarted.advance(ckpt.weights, 6)
    assert restarted.deltas == server.deltas and restarted.sha256 == server.sha256
    assert restarted.manifest_chain() == server.manifest_chain()
    assert not dd.Broadcast(weights, 0).load(ckpt.downlink, 9)  # another version (a rollback): start afresh


def test_malformed_and_oversized_delta_messages_are_rejected_with_a_reason():
    weights = get_weights(build_model("digits_mlp", 0))
    server = dd.Broadcast(weights, 0)
    server.advance(next(walk(weights, 1)), 1)
    good = server.deltas[1]
    with pytest.raises(Rejected) as exc:
        messages.decode_delta(good, len(good) - 1)
    assert exc.value.reason == "oversized"
    with pytest.raises(Rejected) as exc:
        messages.decode_delta(b"\xc1junk", 10**6)
    assert exc.value.reason == "malformed"
    fields = msgpack.unpackb(good, raw=False)

    def broken(**change):
        return messages.decode_delta(msgpack.packb({**fields, **change}, use_bin_type=True), 10**6)

    for change, reason in [({"sha256": "xyz"}, "schema"), ({"version": 0}, "schema"), ({"body": "text"}, "schema"),
                           ({"kind": "model"}, "schema")]:
        with pytest.raises(Rejected) as exc:
            broken(**change)
        assert exc.value.reason == reason, change
    # well-formed headers, hostile tensors: caught when applied, before anything is added
    for change, reason in [({"specs": [["fc1.weight", [3, 3]]]}, "shape"), ({"body": b"\x00" * 50}, "malformed"),
                           ({"state_specs": [["w", [2]]], "state": msgpack.packb([b"\x00" * 8])}, "schema"),
                           ({"state_specs": [["extra.w", [1]]],
                             "state": msgpack.packb([np.float32("nan").tobytes()])}, "non_finite")]:
        with pytest.raises(Rejected) as exc:
            dd.apply(weights, broken(**change), MAX_VALUES)
        assert exc.value.reason == reason, change
    manifest = messages.encode("model", downlink.release(1, "a", weights, chain=[[1, "q" * 16]])[0])
    with pytest.raises(Rejected, match="16 lower-case hex"):
        messages.decode_model(manifest, 10**8)


def test_settings_are_validated_naming_the_key():
    for change, key in [({"downlink": "lossy"}, "downlink must"), ({"downlink_codec": "q3"}, "downlink_codec"),
                        ({"downlink_chain": 0}, "downlink_chain"),
                        ({"downlink": "delta", "model_codec": "float16"}, "model_codec")]:
        with pytest.raises(ValueError, match=key):
            RoundSettings(**change).validate()
    RoundSettings(downlink="full", model_codec="float16").validate()


# --- the agent ------------------------------------------------------------------------

class FakeClient:
    def __init__(self):
        self.subscribed: set[str] = set()

    def subscribe(self, topic, qos=0):  # noqa: ANN001
        for t in topic if isinstance(topic, list) else [(topic, qos)]:
            self.subscribed.add(t[0])

    def unsubscribe(self, topic):  # noqa: ANN001
        self.subscribed -= set(topic if isinstance(topic, list) else [topic])


def make_agent(tmp_path) -> Agent:
    data = datasets.load("digits")
    datasets.save_npz(tmp_path / "data.npz", data.train.subset(np.arange(50)))
    (tmp_path / "agent.toml").write_text(
        f'[broker]\nhost = "127.0.0.1"\nport = 1\nusername = "dev-a"\npassword = "p"\n'
        f'[device]\nid = "dev-a"\ndata = "{tmp_path / "data.npz"}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'signing_key = "{signing.new_key().hex()}"\n')
    return Agent(load_config(tmp_path / "agent.toml"))


class Message:
    def __init__(self, topic: str, payload: bytes, retain: bool = True):
        self.topic, self.payload, self.retain = topic, payload, retain


def send_manifest(agent, client, manifest):
    agent._on_message(client, Message(topics.model("default", manifest.version), messages.encode("model", manifest)))


def send_delta(agent, client, version, payload):
    agent._on_message(client, Message(topics.model_delta("default", version), payload))


def send_chunk(agent, client, version, body):
    agent._on_message(client, Message(topics.model_chunk("default", version, 0), body))


def test_agent_follows_deltas_and_fetches_the_full_model_when_they_do_not_fit(tmp_path, caplog):
    weights = get_weights(build_model("digits_mlp", 0))
    server, steps = dd.Broadcast(weights, 0, chain=2), walk(weights, 12)
    agent, client = make_agent(tmp_path), FakeClient()
    m0, full = release(server, 0)
    send_manifest(agent, client, m0)
    assert client.subscribed == {topics.model_chunks("default", 0)}
    send_chunk(agent, client, 0, full)
    assert client.subscribed == set() and agent.fetch.arrived_via[0] == "full"
    # counted as received, the manifest and the chunk, as the device's first download
    assert agent.state.data["bytes_down_join"] > len(full) and agent.state.data["bytes_down"] == 0
    for version in (1, 2):  # the agent holds version - 1: one delta each, no chunks
        server.advance(next(steps), version)
        manifest, full = release(server, version)
        send_manifest(agent, client, manifest)
        assert client.subscribed == {topics.model_delta("default", version)}
        send_delta(agent, client, version, server.deltas[version])
        assert client.subscribed == set()
        got = agent.fetch.wait_for_model(version, time.time() + 1)
        assert got[1] == full and agent.fetch.arrived_via[version] == "delta"
    assert 0 < agent.fetch.take_down_counts()["bytes_down"] < len(full)  # two manifests and two deltas

    # two manifests before the first one's delta arrived (a slow link): both chains complete
    server.advance(next(steps), 3)
    first, _ = release(server, 3)
    server.advance(next(steps), 4)
    second, full = release(server, 4)
    send_manifest(agent, client, first)
    send_manifest(agent, client, second)
    assert client.subscribed == {topics.model_delta("default", 3), topics.model_delta("default", 4)}
    send_delta(agent, client, 3, server.deltas[3])
    send_delta(agent, client, 4, server.deltas[4])
    assert agent.fetch.wait_for_model(4, time.time() + 1)[1] == full and 3 in agent.fetch.models
    assert client.subscribed == set()

    # a delta that does not reproduce the manifest's model: one line, then the full model
    server.advance(next(steps), 5)
    manifest, full = release(server, 5)
    fields = msgpack.unpackb(server.deltas[5], raw=False)
    forged = msgpack.packb({**fields, "sha256": "0" * 64}, use_bin_type=True)
    send_manifest(agent, client, manifest)
    with caplog.at_level("WARNING"):
        send_delta(agent, client, 5, forged)
    assert client.subscribed == {topics.model_chunks("default", 5)}
    assert "model version 5: cannot use the deltas from version 4 (integrity" in caplog.text
    assert agent.fetch.wait_for_model(5, time.time() + 0.2) is None  # never the unverified model
    send_chunk(agent, client, 5, full)
    assert agent.fetch.wait_for_model(5, time.time() + 1)[1] == full and agent.fetch.arrived_via[5] == "full"

    # a malformed delta: counted with its reason, and the full model instead
    server.advance(next(steps), 6)
    manifest, full = release(server, 6)
    send_manifest(agent, client, manifest)
    send_delta(agent, client, 6, b"\x92junk")
    assert client.subscribed == {topics.model_chunks("default", 6)} and agent.fetch.downlink_rejected["malformed"] == 1
    send_chunk(agent, client, 6, full)

    # too far behind (the agent was away for three versions, the chain keeps two): full model
    for version in (7, 8, 9):
        server.advance(next(steps), version)
    manifest, full = release(server, 9)
    send_manifest(agent, client, manifest)
    assert client.subscribed == {topics.model_chunks("default", 9)}


# --- end to end -----------------------------------------------------------------------

def test_devices_train_from_delta_reconstructed_models_that_match_the_server(tmp_path):
    """Real Mosquitto, coordinator and three agent processes: from round 2 on, every device trains
    from a model it rebuilt from deltas, and its sha256 is that of the server's broadcast model."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--agents", "3",
                             "--rounds", "3", "--dataset", "digits", "--downlink", "delta", "--out", str(out)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    rounds = json.loads((out / "history.json").read_text())["rounds"]
    checkpoints = out / "run" / "coordinator" / "checkpoints"
    for r in rounds[1:]:
        # the broadcast model of the version this round trained from, as the server checkpointed it
        before = unpack((checkpoints / f"round-{r['round'] - 1:06d}.msgpack").read_bytes())
        server_sha = dd.tensors_sha256(before["downlink"]["tensors"])
        assert r["participants"] == 3
        for device, m in r["devices"].items():
            assert m["model_via"] == "delta" and m["model_sha"] == server_sha[:16], (r["round"], device, m)
            assert 0 < m["bytes_down"] < 20_000  # a delta and a manifest, not the 19 KB model
        assert r["global_score"] is not None
    # round 1: every device fetched the full model, its first download
    assert sum(m["bytes_down_join"] for m in rounds[0]["devices"].values()) > 3 * 4 * 4810


def test_the_broker_keeps_the_newest_model_and_the_last_chain_of_deltas_only(broker, mqtt_client):
    """Through a real Mosquitto: after five versions with downlink_chain = 2, a device finds retained
    exactly the newest manifest and its chunk, and the two newest deltas; older ones were cleared."""
    from broker_coordinator.access.broker import COORDINATOR_USER
    from broker_coordinator.engine.loop import Engine
    from tests.conftest import FEDERATION
    coordinator = Engine(FEDERATION, "digits_mlp", datasets.load("digits").test,
                              RoundSettings(downlink="delta", downlink_chain=2))
    coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
    try:
        for version, g in enumerate(walk(dict(coordinator.weights), 5), start=1):
            coordinator.weights, coordinator.version = g, version
            coordinator.publish_model(time.time() + 30)
        device = mqtt_client("dev-a")
        device.subscribe(f"edgefl/{FEDERATION}/model/#")
        give_up = time.monotonic() + 10  # retained messages arrive in one burst after the SUBACK
        while sum(1 for _, payload in device.messages if payload) < 4 and time.monotonic() < give_up:
            device.received.wait(0.2)
        device.received.clear()
        device.received.wait(0.5)  # room for a stale one, which would come in the same burst
    finally:
        coordinator.close()
    retained = {topic for topic, payload in device.messages if payload}
    assert retained == {topics.model(FEDERATION, 5), topics.model_chunk(FEDERATION, 5, 0),
                        topics.model_delta(FEDERATION, 4), topics.model_delta(FEDERATION, 5)}
    manifest = messages.decode_model(dict(device.messages)[topics.model(FEDERATION, 5)], 10**8)
    assert [v for v, _ in manifest.chain] == [4, 5] and manifest.sha256 == coordinator.broadcast.sha256
