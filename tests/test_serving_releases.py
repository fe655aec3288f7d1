"""The model the coordinator vouches for, published for the devices to serve ([serving])."""

from __future__ import annotations

import time

import numpy as np

from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.serving import read_published, request_promote
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.settings.serving_settings import ServingSettings
from broker_coordinator.simulation.in_memory import fold_round
from broker_coordinator.simulation.processes import stop_processes
from broker_coordinator.storage.store import Store
from edgefl_protocol import codec, downlink, messages, signing, topics
from edgefl_models import datasets

FED = "srv"
DEVICES = ("d1", "d2", "d3")
KEYS = {d: signing.new_key() for d in DEVICES}


def engine(tmp_path, **serving) -> Engine:
    settings = RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean", serve_average=0.5)
    return Engine(FED, "digits_mlp", datasets.load("digits").test, settings, store=Store(tmp_path),
                  device_keys=KEYS, serving=ServingSettings(**serving))


def answers(e: Engine, scale: float, seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    out = {}
    for d in DEVICES:
        delta = {k: (scale * rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in e.weights.items()}
        encoded = codec.encode(delta, "float32")
        update = messages.Update(d, e.next_round, e.version, 10, {"steps": 1}, encoded.body, "float32",
                                 encoded.specs, FED)
        out[d] = messages.encode_update(update, KEYS[d])
    return out


def retained_release(e: Engine) -> tuple[messages.ModelRelease, dict[str, np.ndarray]]:
    """What a device fetches: the manifest, then its chunks, checked against its sha256."""
    retained = e.transport.retained
    manifest = messages.decode_model(retained[topics.serving(FED)], 1 << 26)
    assembly = downlink.Assembly(manifest)
    for i in range(manifest.chunks):
        assembly.add(i, retained[topics.serving_chunk(FED, manifest.version, i)])
    return manifest, downlink.decode_weights(manifest, assembly.body(), None, 1 << 26)


def test_each_version_publishes_the_served_average_for_serving(tmp_path):
    e = engine(tmp_path, only_better=False, downlink="full")  # in full: the average itself (deltas: test_serving_deltas)
    for round_no in (1, 2):
        fold_round(e, answers(e, 1.0, seed=round_no), round_no)
    manifest, weights = retained_release(e)
    assert manifest.version == e.version == 2
    for name, served in e.served.weights.items():  # the served average, not the last global model
        np.testing.assert_allclose(weights[name], served, rtol=1e-6)
    assert not all(np.allclose(e.served.weights[n], e.weights[n]) for n in e.weights)
    assert topics.serving_chunk(FED, 1, 0) not in e.transport.retained  # the previous release's chunks cleared
    published = read_published(tmp_path)
    assert (published["version"], published["round"], published["weights"]) == (2, 2, "served")


def test_only_a_version_at_least_as_good_replaces_the_published_one_and_promote_overrides(tmp_path):
    e = engine(tmp_path)
    fold_round(e, answers(e, 1.0), 1)
    first = read_published(tmp_path)
    fold_round(e, answers(e, 400.0, seed=7), 2)  # huge random steps: the served model gets worse
    assert read_published(tmp_path)["version"] == first["version"] == 1  # kept: the new one scored worse
    request_promote(tmp_path, 2)
    e.idle(0.0)  # a running coordinator reads the request between rounds
    assert read_published(tmp_path)["version"] == 2 and read_published(tmp_path)["weights"] == "promoted"
    assert retained_release(e)[0].version == 2


def test_serving_off_publishes_nothing(tmp_path):
    e = engine(tmp_path, publish="off")
    fold_round(e, answers(e, 1.0), 1)
    assert topics.serving(FED) not in e.transport.retained and read_published(tmp_path) is None


def test_a_real_agent_serves_the_release_the_coordinator_vouches_for(tmp_path):
    """Real Mosquitto, two real agents: release 1 arrives in full, release 2 as a delta from it, and
    each device's serving store then holds the coordinator's serving release of version 2 (the served
    average, as the deltas reconstruct it) bit for bit; a corrupted release (a chunk that fails the
    manifest's sha256) is refused and version 2 keeps serving; the round record says what each device
    served."""
    from broker_coordinator.access.broker import COORDINATOR_USER
    from broker_coordinator.simulation.private_broker import PrivateBroker
    from edge_agent.serving import read_current
    from tests.fleet import Fleet

    broker = PrivateBroker(tmp_path / "broker", "rel")
    broker.add_user(COORDINATOR_USER)
    for d in ("dev-0", "dev-1"):
        broker.add_user(d)
    with broker:
        fleet = Fleet(tmp_path, broker, "rel", ["dev-0", "dev-1"])
        e = Engine("rel", "digits_mlp", fleet.test, RoundSettings(local_epochs=1, serve_average=0.5, round_timeout=30),
                   store=Store(tmp_path / "coordinator"), device_keys=fleet.keys,
                   serving=ServingSettings(only_better=False))
        e.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            e.wait_for_devices(2, 60)
            e.run_round(1)
            give_up = time.monotonic() + 60
            while not all("serving release 1 fetched in full" in fleet.logs[d].read_text() for d in ("dev-0", "dev-1")):
                assert time.monotonic() < give_up, [fleet.logs[d].read_text()[-800:] for d in ("dev-0", "dev-1")]
                e.idle(0.2)
            second = e.run_round(2)
            stores = [tmp_path / d / "state" / "serving" for d in ("dev-0", "dev-1")]

            def serving(store):  # noqa: ANN001, ANN202
                try:
                    return read_current(store)
                except Exception:  # noqa: BLE001 - not there yet
                    return None
            while not all((got := serving(s)) and got[1]["version"] == 2 for s in stores):
                assert time.monotonic() < give_up, [serving(s) and serving(s)[1] for s in stores]
                e.idle(0.2)  # the devices settle and fetch between tasks; the coordinator keeps its session
            import io

            import torch
            for store in stores:
                _, meta, body = read_current(store)
                held = torch.load(io.BytesIO(body), weights_only=True)
                for name, released in e.serving.stream.tensors.items():
                    np.testing.assert_array_equal(held[name].numpy(), released)
            assert all("serving release 2 fetched as 1 delta(s)" in fleet.logs[d].read_text() for d in ("dev-0", "dev-1"))
            # a corrupted serving release (one chunk's bytes changed) is refused: the devices keep version 2
            manifest, chunks = downlink.release(99, "digits_mlp", e.served.weights, e.settings.model_codec,
                                                e.settings.model_chunk_bytes, e.releases.fingerprint)
            chunks[0] = bytes(b ^ 0xFF for b in chunks[0])
            for i, chunk in enumerate(chunks):
                assert e.transport.publish_until(topics.serving_chunk("rel", 99, i), chunk, time.time() + 10,
                                                 retain=True)
            assert e.transport.publish_until(topics.serving("rel"), messages.encode("model", manifest),
                                             time.time() + 10, retain=True)
            while not all("model version 99 fails its sha256 check" in fleet.logs[d].read_text()
                          for d in ("dev-0", "dev-1")):
                assert time.monotonic() < give_up + 60, [fleet.logs[d].read_text()[-800:] for d in ("dev-0", "dev-1")]
                e.idle(0.2)
            assert all(read_current(s)[1]["version"] == 2 for s in stores)
            # what each device served during round 2, and why, is in that round's record
            for device in ("dev-0", "dev-1"):
                assert second.devices[device]["serving_current"] >= 0, second.devices[device]
                assert "published" in second.devices[device]["serving_decision"], second.devices[device]
        finally:
            e.close()
            fleet.stop()


def test_real_agents_keep_a_worse_release_out_of_their_stores(tmp_path):
    """Real Mosquitto, two real agents holding out a fifth of their data: after three rounds they
    serve version 3; a release of an untrained model (version 99, whole and with the right sha256) is
    fetched, scored on each device's held-out data, refused by its gate, and version 3 keeps serving."""
    from broker_coordinator.access.broker import COORDINATOR_USER
    from broker_coordinator.simulation.private_broker import PrivateBroker
    from edge_agent.serving import read_current
    from edgefl_models import partition
    from edgefl_models.architectures import build_model, get_weights
    from edgefl_protocol.settings import to_toml
    from tests.fleet import spawn

    data = datasets.load("digits")
    devices = ["dev-0", "dev-1"]
    broker = PrivateBroker(tmp_path / "broker", "gate")
    broker.add_user(COORDINATOR_USER)
    keys = {d: signing.new_key() for d in devices}
    for d in devices:
        broker.add_user(d)
    agents = []
    with broker:
        for d, rows in zip(devices, partition.split("iid", data.train.y, len(devices), 0)):
            home = tmp_path / d
            datasets.save_npz(home / "data.npz", data.train.subset(rows))
            (home / "agent.toml").write_text(to_toml({
                "broker": {"host": broker.host, "port": broker.port, "username": d, "password": broker.users[d]},
                "device": {"id": d, "state_dir": str(home / "state"), "federation": "gate", "threads": 1,
                           "signing_key": keys[d].hex()},
                "data": {"source": "npz", "path": str(home / "data.npz"), "holdout": 0.2}}))
            agents.append(spawn(["-m", "edge_agent", "run", "--config", str(home / "agent.toml")], home / "agent.log"))
        e = Engine("gate", "digits_mlp", data.test, RoundSettings(local_epochs=2, round_timeout=30),
                   store=Store(tmp_path / "coordinator"), device_keys=keys, serving=ServingSettings(only_better=False))
        e.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            e.wait_for_devices(2, 60)
            for round_no in (1, 2, 3):
                e.run_round(round_no)
            stores = [tmp_path / d / "state" / "serving" for d in devices]

            def serving(store):  # noqa: ANN001, ANN202
                try:
                    return read_current(store)[1]["version"]
                except Exception:  # noqa: BLE001 - not there yet
                    return None
            give_up = time.monotonic() + 60
            while not all(serving(s) == 3 for s in stores):
                assert time.monotonic() < give_up, [serving(s) for s in stores]
                e.idle(0.2)
            untrained = get_weights(build_model("digits_mlp", seed=99))
            manifest, chunks = downlink.release(99, "digits_mlp", untrained, e.settings.model_codec,
                                                e.settings.model_chunk_bytes, e.releases.fingerprint)
            for i, chunk in enumerate(chunks):
                assert e.transport.publish_until(topics.serving_chunk("gate", 99, i), chunk, time.time() + 10,
                                                 retain=True)
            assert e.transport.publish_until(topics.serving("gate"), messages.encode("model", manifest),
                                             time.time() + 10, retain=True)
            logs = [tmp_path / d / "agent.log" for d in devices]
            while not all("serving: kept 3, refused 99" in log.read_text() for log in logs):
                assert time.monotonic() < give_up + 60, [log.read_text()[-1500:] for log in logs]
                e.idle(0.2)
            assert all(serving(s) == 3 for s in stores)  # the untrained model never reached the applications
            assert not any((s / "99").exists() for s in stores)
        finally:
            e.close()
            stop_processes(agents)
