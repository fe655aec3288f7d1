"""The device's serving store: publish and swap, keep N, the local gate, the Python API, `edge-agent model`."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.private_broker import PrivateBroker
from broker_coordinator.storage.store import Store
from edge_agent.config import ServingSettings, load_config
from edge_agent.personalize import PRIOR_STRENGTHS, personalize
from edge_agent.serving import ServedModel, read_current
from edge_agent.serving_gate import ServingGate
from edge_agent.serving_store import CURRENT, METADATA, WEIGHTS, ServingStore, StoreError
from edgefl_protocol import messages
from edgefl_protocol.settings import to_toml
from edgefl_models import datasets
from edgefl_models.architectures import build_model, fingerprint
from edgefl_models.objectives import Objective

from .fleet import ROOT, Fleet

ARCH = "digits_mlp"


def meta(version: int) -> dict:
    model = build_model(ARCH)
    return {"round": version, "architecture": ARCH, "fingerprint": fingerprint(model), "task": "classification",
            "score": None}


def publish_random(store: ServingStore, version: int) -> dict:
    model = build_model(ARCH, seed=version)
    store.publish(version, model.state_dict(), meta(version))
    return model.state_dict()


def release(version: int) -> messages.ModelRelease:
    model = build_model(ARCH)
    return messages.ModelRelease(version, ARCH, "fp32", [], 0, f"{version:064x}", 1, 1, fingerprint(model))


def test_publish_swaps_current_keeps_n_and_never_changes_a_published_version(tmp_path):
    store = ServingStore(tmp_path / "serving", keep=2)
    assert store.current_version() is None
    publish_random(store, 1)
    assert store.current_version() == 1 and os.readlink(store.root / CURRENT) == "1"
    first = (store.root / "1" / WEIGHTS).read_bytes()
    described = store.metadata(1)
    assert described["sha256"] == hashlib.sha256(first).hexdigest()
    assert {"version", "round", "architecture", "fingerprint", "published_at", "score"} <= set(described)
    assert oct((store.root / "1").stat().st_mode & 0o777) == oct(0o750)
    assert oct((store.root / "1" / WEIGHTS).stat().st_mode & 0o777) == oct(0o640)

    with pytest.raises(StoreError, match="never changes"):
        publish_random(store, 1)
    assert (store.root / "1" / WEIGHTS).read_bytes() == first

    for version in (2, 3, 4):
        publish_random(store, version)
    assert store.versions() == [3, 4] and store.current_version() == 4
    store.make_current(3)  # the current one is kept even when older than the newest N
    publish_random(store, 5)
    assert store.versions() == [4, 5]  # 3 is no longer current: pruned
    assert store.current_version() == 5
    assert not [p for p in store.root.iterdir() if p.name.startswith(".")]  # no temp dirs or links left


def test_concurrent_readers_never_see_a_torn_or_partial_version_in_200_swaps(tmp_path):
    store = ServingStore(tmp_path / "serving", keep=2)
    publish_random(store, 0)
    stop = threading.Event()
    reads, failures = [0], []

    def reader() -> None:
        while not stop.is_set():
            try:
                target, described, body = read_current(store.root)  # checks sha256 against metadata
                assert int(target) == described["version"]
                if reads[0] % 20 == 0:  # and now and then that the bytes are a whole state_dict
                    assert set(torch.load(io.BytesIO(body), weights_only=True)) == set(names)
                reads[0] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is a torn read
                failures.append(repr(exc))

    names = list(build_model(ARCH).state_dict())
    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    base = build_model(ARCH).state_dict()
    try:
        for version in range(1, 201):  # every version's bytes differ: a mix of two would fail its sha256
            store.publish(version, {k: v + version for k, v in base.items()}, meta(version))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert failures == [] and reads[0] > 50
    assert store.current_version() == 200 and store.versions() == [199, 200]


def trained_and_random() -> tuple[torch.nn.Module, torch.nn.Module, datasets.Dataset]:
    data = datasets.load("digits")
    torch.manual_seed(0)
    trained = build_model(ARCH, seed=1)
    optimizer = torch.optim.Adam(trained.parameters(), lr=0.01)
    x, y = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y)
    for _ in range(150):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(trained(x), y).backward()
        optimizer.step()
    return trained, build_model(ARCH, seed=2), data.test


def test_gate_keeps_the_current_model_when_the_new_one_is_worse_on_held_out_data(tmp_path, caplog):
    trained, random_model, held_out = trained_and_random()
    objective = Objective.of("classification")
    gate = ServingGate(ServingSettings(dir=str(tmp_path / "serving")))
    first = gate.offer(release(1), 1, trained, held_out, objective)
    assert first.published and first.new_score > 0.8 and first.current_score is None
    assert gate.store.metadata(1)["score"]["value"] == pytest.approx(first.new_score)

    worse = gate.offer(release(2), 2, random_model, held_out, objective)
    assert not worse.published and gate.store.current_version() == 1 and not gate.store.has(2)
    assert worse.current_score == pytest.approx(first.new_score) and worse.new_score < 0.5
    assert "kept 1, refused 2" in worse.text()
    assert not gate.wants(2)  # offered once

    off = ServingGate(ServingSettings(dir=str(tmp_path / "serving"), gate=False))
    assert off.offer(release(3), 3, random_model, held_out, objective).published

    nothing_held_out = ServingGate(ServingSettings(dir=str(tmp_path / "other")))
    with caplog.at_level(logging.INFO, logger="edge_agent.serving"):
        decision = nothing_held_out.offer(release(1), 1, random_model, datasets.Dataset(held_out.x[:0],
                                                                                        held_out.y[:0]), objective)
        nothing_held_out.offer(release(2), 2, random_model, datasets.Dataset(held_out.x[:0], held_out.y[:0]),
                               objective)
    assert decision.published and caplog.text.count("the gate has nothing to judge") == 1


@pytest.mark.parametrize("how", ["tune", "prior"])
def test_personalized_serving_serves_its_own_copy_when_it_does_better_on_the_devices_data(tmp_path, how):
    """A device whose data holds only digits 0-4: a copy of the released model fine-tuned there, or
    given the device's label frequencies (the release itself untouched), scores better on its held-out
    data and is what it serves; with personalization off the release is served as it came."""
    data = datasets.load("digits")
    own = lambda d: datasets.Dataset(d.x[d.y < 5], d.y[d.y < 5])  # noqa: E731 - this device's classes
    train, held_out = own(data.train), own(data.test)
    released = build_model(ARCH, seed=3)  # a poor global model: much to gain locally
    before = {k: v.clone() for k, v in released.state_dict().items()}
    objective = Objective.of("classification")
    gate = ServingGate(ServingSettings(dir=str(tmp_path / "serving"), personalize=how, personalize_steps=60,
                                       personalize_lr=0.05))
    decision = gate.offer(release(1), 1, released, held_out, objective, train)
    assert decision.published and decision.released_score is not None
    assert decision.new_score > decision.released_score + 0.1, decision
    assert all(torch.equal(before[k], v) for k, v in released.state_dict().items())  # the release is untouched
    meta = gate.store.metadata(1)
    assert meta["personalized"] == {"how": how, "released_score": pytest.approx(decision.released_score),
                                    **({"steps": 60} if how == "tune" else {"strength": meta["personalized"]["strength"]})}
    assert how == "tune" or meta["personalized"]["strength"] in PRIOR_STRENGTHS
    assert "personalized" in decision.text()
    plain = ServingGate(ServingSettings(dir=str(tmp_path / "plain")))
    as_released = plain.offer(release(1), 1, released, held_out, objective, train)
    assert as_released.released_score is None and plain.store.metadata(1)["personalized"] is None


class ConstantLogits(torch.nn.Module):
    """A classifier that says the same logits whatever it is shown, with a last bias per class."""

    def __init__(self, logits: np.ndarray) -> None:
        super().__init__()
        self.head = torch.nn.Linear(1, len(logits))
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.copy_(torch.as_tensor(logits, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x[:, :1])


def test_the_label_priors_strength_is_the_one_the_devices_own_data_fits_best():
    """Bayes' rule (strength 1) for a model that knows nothing of this device's labels; none for one
    that already predicts them at the device's frequencies; the release itself untouched."""
    labels = np.array([0] * 60 + [1] * 30 + [2] * 10)
    train = datasets.Dataset(np.zeros((100, 3), dtype=np.float32), labels)
    objective = Objective.of("classification")
    uniform = ConstantLogits(np.zeros(3))
    own = personalize(uniform, train, objective, "prior", 0, 0.0)
    assert own.detail == {"strength": 1.0}
    assert torch.equal(uniform.head.bias, torch.zeros(3))
    assert own.model(torch.zeros(1, 3)).argmax().item() == 0
    frequencies = np.log((np.bincount(labels) + 0.5) / (len(labels) + 1.5))
    assert personalize(ConstantLogits(frequencies), train, objective, "prior", 0, 0.0).detail == {"strength": 0.0}


def test_served_model_reloads_after_a_swap(tmp_path):
    store = ServingStore(tmp_path / "serving")
    publish_random(store, 1)
    served = ServedModel(store.root)
    x = np.random.default_rng(0).random((5, 64), dtype=np.float32)
    first = served.model()
    assert served.metadata["version"] == 1 and served.model() is first  # not reloaded while current
    expected = publish_random(store, 2)
    assert served.metadata["version"] == 2 and served.model() is not first
    assert all(torch.equal(served.model().state_dict()[k], v) for k, v in expected.items())
    predicted = served.predict(x)
    assert predicted.shape == (5,) and predicted.dtype.kind == "i"


def write_config(tmp_path: Path, serving: dict) -> Path:
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((4, 64), np.float32), y=np.zeros(4, np.int64))
    config = tmp_path / "agent.toml"
    config.write_text(to_toml({"broker": {"host": "localhost", "port": 1883, "username": "d", "password": "p"},
                               "device": {"id": "d", "state_dir": str(tmp_path / "state"), "data": str(data)},
                               "serving": serving}))
    return config


def test_config_default_dir_is_under_the_state_dir_and_empty_turns_it_off(tmp_path):
    assert load_config(write_config(tmp_path, {})).serving.dir == str(tmp_path / "state" / "serving")
    assert load_config(write_config(tmp_path, {"dir": ""})).serving.dir == ""


def edge_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_agent", "model", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)


def test_model_commands_show_export_predict(tmp_path):
    config = write_config(tmp_path, {"keep": 2})
    empty = edge_agent("show", "--config", str(config))
    assert empty.returncode == 2 and "no current model yet" in empty.stderr
    store = ServingStore(load_config(config).serving.dir, keep=2)
    for version in (1, 2, 3):
        publish_random(store, version)

    shown = edge_agent("show", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    assert "current:  version 3" in shown.stdout and "kept:     2, 3" in shown.stdout

    out = tmp_path / "exported"
    exported = edge_agent("export", str(out), "--config", str(config))
    assert exported.returncode == 0, exported.stderr
    assert (out / WEIGHTS).read_bytes() == (store.root / "3" / WEIGHTS).read_bytes()
    assert json.loads((out / METADATA).read_text())["version"] == 3
    assert not (out / "model.onnx").exists() and "(model.pt, metadata.json)" in exported.stdout  # the store had none

    x = np.random.default_rng(1).random((3, 64), dtype=np.float32)
    np.savez(tmp_path / "batch.npz", x=x)
    np.save(tmp_path / "batch.npy", x)
    expected = ServedModel(store.root).predict(x).tolist()
    for name in ("batch.npz", "batch.npy"):
        predicted = edge_agent("predict", str(tmp_path / name), "--dir", str(store.root))
        assert predicted.returncode == 0, predicted.stderr
        assert [json.loads(line) for line in predicted.stdout.splitlines()] == expected
    np.savez(tmp_path / "wrong.npz", y=x)
    assert "no array named x" in edge_agent("predict", str(tmp_path / "wrong.npz"), "--dir", str(store.root)).stderr


def test_a_real_agent_serves_the_version_it_trained_from(tmp_path):
    broker = PrivateBroker(tmp_path / "broker", "srv")
    broker.add_user(COORDINATOR_USER)
    broker.add_user("dev-0")
    with broker:
        fleet = Fleet(tmp_path, broker, "srv", ["dev-0"])
        coordinator = Engine("srv", ARCH, fleet.test, RoundSettings(local_epochs=1, min_updates=1, round_timeout=60),
                             store=Store(tmp_path / "coordinator"), device_keys=fleet.keys)
        coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        try:
            coordinator.wait_for_devices(1, 120)
            record = coordinator.run_round(1)
            assert record.participants == 1
            served = ServedModel(tmp_path / "dev-0" / "state" / "serving")
            give_up = time.monotonic() + 10
            while not (served.path / CURRENT).exists() and time.monotonic() < give_up:
                time.sleep(0.1)
            described = served.metadata
            assert described["round"] == 1 and described["architecture"] == ARCH
            assert served.path.joinpath(str(described["version"]), WEIGHTS).exists()
            assert served.predict(fleet.test.x[:4]).shape == (4,)
            assert "serving: published" in fleet.logs["dev-0"].read_text()
        finally:
            coordinator.close()
            fleet.stop()


def test_a_version_published_through_the_gate_keeps_an_onnx_file_that_predicts_as_torch_does(tmp_path):
    """Where the onnx package is installed (edgefl[onnx]), each version's directory holds model.onnx
    beside model.pt, with its sha256 in metadata.json; onnxruntime's outputs match torch's within 1e-5."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    data = datasets.load("digits")
    model = build_model(ARCH, seed=5)
    gate = ServingGate(ServingSettings(dir=str(tmp_path / "serving")))
    assert gate.offer(release(1), 1, model, data.test, Objective.of("classification")).published
    version = tmp_path / "serving" / "1"
    meta = json.loads((version / "metadata.json").read_text())
    onnx_file = version / "model.onnx"
    assert meta["onnx_sha256"] == hashlib.sha256(onnx_file.read_bytes()).hexdigest()
    assert oct(onnx_file.stat().st_mode & 0o777) == oct(0o640)  # as the store's other files
    x = data.test.x[:64].astype(np.float32)
    got = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    assert np.abs(got - want).max() <= 1e-5
    exported = edge_agent("export", str(tmp_path / "out"), "--dir", str(tmp_path / "serving"))
    assert exported.returncode == 0 and "(model.pt, model.onnx, metadata.json)" in exported.stdout, exported.stderr
    assert (tmp_path / "out" / "model.onnx").read_bytes() == onnx_file.read_bytes()


def test_without_the_onnx_package_a_version_is_published_without_model_onnx(tmp_path, monkeypatch, caplog):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a))
    gate = ServingGate(ServingSettings(dir=str(tmp_path / "serving")))
    data = datasets.load("digits")
    with caplog.at_level(logging.INFO, logger="edge_agent.serving"):
        for version in (1, 2):
            gate.offer(release(version), version, build_model(ARCH, seed=version), data.test,
                       Objective.of("classification"))
    assert not (tmp_path / "serving" / "2" / "model.onnx").exists()
    assert json.loads((tmp_path / "serving" / "2" / "metadata.json").read_text())["onnx_sha256"] is None
    assert caplog.text.count("no model.onnx beside model.pt") == 1 and "pip install edgefl[onnx]" in caplog.text
