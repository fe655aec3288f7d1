"""End to end through a real Mosquitto: a forged and an oversized update are each
rejected with their reason, and a replayed one is answered with its verdict and
never folded again, while training goes on.

dev-a is a real agent process training on digits; dev-b is a real paho client
that answers its tasks by hand: genuine updates (a zero delta, signed with its
key) plus the hostile ones, sent before the genuine one on the same topic so
the broker delivers them to the open round in that order.
"""

import time

import numpy as np

from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.simulate import SimulationSpec, spawn_agent, stop_processes, write_agent_config
from edge_agent.agent import Agent
from edge_agent.config import load_config
from edgefl_protocol import codec, downlink, messages, signing, topics
from edgefl_models import datasets
from edgefl_models.architectures import build_model, get_weights

from .conftest import FEDERATION


class HandDevice:
    """dev-b: online status, then per task a scripted list of payloads ending with a genuine update."""

    def __init__(self, recorder, key: bytes, specs: dict) -> None:
        self.recorder, self.key, self.specs = recorder, key, specs
        self.sent: dict[int, bytes] = {}
        self.errors: list[BaseException] = []
        recorder.client.on_message = self._on_task
        recorder.subscribe(topics.task(FEDERATION, "dev-b"))
        status = messages.encode("status", messages.Status("dev-b", "online"))
        recorder.client.publish(topics.status(FEDERATION, "dev-b"), status, qos=1, retain=True).wait_for_publish(5)

    def genuine(self, task: messages.Task) -> bytes:
        encoded = codec.encode({n: np.zeros(s, np.float32) for n, s in self.specs.items()}, task.codec)
        update = messages.Update("dev-b", task.round, task.model_version, 50, {"train_loss": 1.0},
                                 encoded.body, encoded.codec, encoded.specs, FEDERATION)
        return messages.encode_update(update, self.key)

    def _on_task(self, client, userdata, msg) -> None:  # noqa: ANN001
        try:
            task = messages.decode_task(msg.payload)
            genuine = self.genuine(task)
            if task.round == 1:
                forged = signing.sign(genuine[4 + signing.TAG_BYTES:], signing.new_key())  # not dev-b's key
                hostile = [forged, signing.MAGIC + b"\0" * 200_000]  # oversized: over the coordinator's cap
            elif task.round == 2:
                hostile = [self.sent[1]]  # round 1's genuine update, replayed byte for byte
            else:
                hostile = []
            for payload in [*hostile, genuine]:
                client.publish(topics.update(FEDERATION, "dev-b"), payload, qos=1)
            self.sent[task.round] = genuine
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)


def test_forged_and_oversized_updates_are_rejected_and_a_replay_never_folds_twice(broker, mqtt_client, tmp_path):
    data = datasets.load("digits")
    shard = tmp_path / "dev-a" / "data.npz"
    datasets.save_npz(shard, data.train.subset(np.arange(600)))
    keys = {"dev-a": signing.new_key(), "dev-b": signing.new_key()}
    settings = RoundSettings(round_timeout=90, local_epochs=1, codec="topk0.1+q8+zlib", model_chunk_bytes=4096)
    coordinator = Engine(FEDERATION, "digits_mlp", data.test, settings, device_keys=keys)
    coordinator.connect(broker.host, broker.port, "coordinator", broker.users["coordinator"])
    config = tmp_path / "dev-a" / "agent.toml"
    write_agent_config(config, "dev-a", broker.users["dev-a"], broker.port,
                       SimulationSpec(federation=FEDERATION, agent_threads=1), shard, keys["dev-a"])
    agent = spawn_agent(config, tmp_path / "dev-a" / "agent.log")
    try:
        hand = HandDevice(mqtt_client("dev-b"), keys["dev-b"], coordinator.specs)
        coordinator.wait_for_devices(2, 60)
        initial = {k: v.copy() for k, v in coordinator.weights.items()}
        records = [coordinator.run_round(r) for r in (1, 2, 3)]
    finally:
        stop_processes([agent])
        coordinator.close()
    log = (tmp_path / "dev-a" / "agent.log").read_text()
    assert not hand.errors, hand.errors
    assert [(r.participants, r.closed) for r in records] == [(2, "complete")] * 3, log
    assert records[0].rejected == {"signature": 1, "oversized": 1}
    assert records[1].rejected == {}  # the replay of round 1: the same bytes, answered with round 1's verdict
    assert records[2].rejected == {}
    assert coordinator.intake.rejections == {"signature": 1, "oversized": 1}
    assert coordinator.verdicts.of(("dev-b", 2, 1)).counted  # round 2 folded dev-b's own round 2 update
    assert coordinator.version == 3 and any(not np.array_equal(initial[k], coordinator.weights[k]) for k in initial)
    assert log.count("trained (") == 3 and log.count("update rejected") == 0
    assert log.count("update accepted by the coordinator: ") >= 2  # with its verdict; the last may race the shutdown


class FakeClient:
    def __init__(self) -> None:
        self.subscribed: list[str] = []

    def subscribe(self, topic, qos=0):  # noqa: ANN001
        self.subscribed.append(topic)

    def unsubscribe(self, topic):  # noqa: ANN001
        self.subscribed.remove(topic)


def test_agent_fetches_chunks_once_and_not_again_when_it_has_the_bytes(tmp_path):
    data = datasets.load("digits")
    datasets.save_npz(tmp_path / "data.npz", data.train.subset(np.arange(50)))
    (tmp_path / "agent.toml").write_text(
        f'[broker]\nhost = "127.0.0.1"\nport = 1\nusername = "dev-a"\npassword = "p"\n'
        f'[device]\nid = "dev-a"\ndata = "{tmp_path / "data.npz"}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'signing_key = "{signing.new_key().hex()}"\n')
    weights = get_weights(build_model("digits_mlp"))
    manifest, chunks = downlink.release(0, "digits_mlp", weights, "float32", chunk_bytes=1024)
    agent, client = Agent(load_config(tmp_path / "agent.toml")), FakeClient()
    agent.fetch.on_manifest(client, manifest)
    assert client.subscribed == [topics.model_chunks("default", 0)]
    for i, chunk in enumerate(chunks):
        agent.fetch.on_chunk(client, 0, i, chunk)
    assert client.subscribed == [] and agent.fetch.wait_for_model(0, time.time() + 1)[1] == b"".join(chunks)
    agent.fetch.remember_model(manifest, b"".join(chunks))

    # the same bytes published again as the next version (e.g. an abandoned round), and after a restart
    same = downlink.release(1, "digits_mlp", weights, "float32", chunk_bytes=1024)[0]
    agent.fetch.on_manifest(client, same)
    restarted = Agent(load_config(tmp_path / "agent.toml"))
    restarted.fetch.on_manifest(client, same)
    assert client.subscribed == [] and restarted.fetch.wait_for_model(1, time.time() + 1) is not None
