"""`broker-coordinator model list | export` (storage/export.py): a state directory written by a real
Engine over a few rounds (no broker: simulation/in_memory.py), listed and exported in each format,
and the exported files give the engine's own predictions."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from broker_coordinator.cli.cli import main
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.in_memory import fold_round
from broker_coordinator.storage import export as export_mod
from broker_coordinator.storage.store import Store, StoreError
from broker_coordinator.storage.tasks import TaskDefinition, Tasks
from edgefl_protocol import codec, messages, signing
from edgefl_models import datasets
from edgefl_models.architectures import build_model, fingerprint, set_weights

FED, ARCH, ROUNDS = "exp", "digits_mlp", 3
DEVICES = [f"d{i}" for i in range(4)]


def _run_rounds(state: Path, digits, serve_average: float) -> Engine:
    tasks = Tasks(state)
    tasks.begin(TaskDefinition(ARCH, "", "classification", "cross_entropy", "fedavg", "t"))
    tasks.close()
    store = Store(state, keep=10)
    keys = {d: signing.new_key() for d in DEVICES}
    settings = RoundSettings(algorithm="fedavg", codec="float32", weighting="uniform", norm_bound=0,
                             round_timeout=60, serve_average=serve_average)
    engine = Engine(FED, ARCH, digits.test, settings, store=store, device_keys=keys)
    rng = np.random.default_rng(0)
    for round_no in range(1, ROUNDS + 1):
        answers = {}
        for device in DEVICES:
            delta = {n: 0.05 * rng.standard_normal(s).astype(np.float32) for n, s in engine.specs.items()}
            encoded = codec.encode(delta, "float32")
            update = messages.Update(device, round_no, engine.version, 50, {"steps": 1}, encoded.body,
                                     encoded.codec, encoded.specs, FED, 1)
            answers[device] = messages.encode_update(update, keys[device])
        fold_round(engine, answers, round_no)
    store.close()
    return engine


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


@pytest.fixture(scope="module")
def state(tmp_path_factory, digits):
    path = tmp_path_factory.mktemp("state")
    engine = _run_rounds(path, digits, 0.75)
    return path, engine


def _config(tmp_path: Path, state: Path) -> Path:
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[federation]\nname = "{FED}"\nmodel = "{ARCH}"\n[broker]\npassword = "x"\n'
                      f'[storage]\nstate_dir = "{state}"\n')
    return config


def _predict(weights: dict, x: torch.Tensor) -> torch.Tensor:
    model = build_model(ARCH).eval()
    set_weights(model, weights)
    with torch.no_grad():
        return model(x)


def test_list_shows_every_kept_version_with_score_and_the_current_one(state, tmp_path, capsys):
    path, engine = state
    versions, problems = export_mod.model_versions(path)
    assert not problems
    assert [v.version for v in versions] == [1, 2, 3] and [v.round for v in versions] == [1, 2, 3]
    assert [v.current for v in versions] == [False, False, True]
    assert all(v.served and v.metric == "accuracy" and v.scored_by == "central" for v in versions)
    assert 0 <= versions[-1].score <= 1
    assert main(["model", "list", "--config", str(_config(tmp_path, path))]) == 0
    out = capsys.readouterr().out
    assert "VERSION" in out and "current" in out and "served average" in out and "accuracy" in out


def test_state_dict_export_gives_the_served_models_predictions_and_metadata(state, tmp_path, digits, capsys):
    path, engine = state
    out = tmp_path / "export"
    assert main(["model", "export", "--version", "3", "--config", str(_config(tmp_path, path)), str(out)]) == 0
    assert "exported model version 3" in capsys.readouterr().out
    meta = json.loads((out / "metadata.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["metadata.json", "model.pt"]
    assert meta["sha256"] == hashlib.sha256((out / "model.pt").read_bytes()).hexdigest()
    model = build_model(ARCH).eval()
    assert meta["fingerprint"] == fingerprint(model)
    assert (meta["version"], meta["round"], meta["task"], meta["weights"], meta["format"]) == (3, 3, 1, "served",
                                                                                                "state_dict")
    assert meta["architecture"] == ARCH and meta["input_shape"] == [64] and meta["outputs"] == 10
    assert meta["label_names"] == [str(i) for i in range(10)]
    record = Store(path).load_checkpoint().record
    assert meta["metric"] == "accuracy" and meta["score"] == pytest.approx(record["score"])
    assert meta["exporter"]["package"] == "edgefl" and meta["exporter"]["version"]
    model.load_state_dict(torch.load(out / "model.pt"))
    x = torch.from_numpy(digits.test.x[:50]).float()
    with torch.no_grad():
        got = model(x)
    assert torch.equal(got, _predict(engine.served.weights, x))
    with torch.no_grad():
        assert torch.equal(got, engine.served_model.eval()(x))
    assert not torch.equal(got, _predict(engine.weights, x))  # the served average, not the last model


def test_last_and_an_older_version_export_the_last_global_models(state, tmp_path, digits):
    path, engine = state
    done = export_mod.export_model(path, None, tmp_path / "last", last=True)
    assert done.metadata["weights"] == "last" and done.metadata["version"] == 3
    x = torch.from_numpy(digits.test.x[:20]).float()
    model = build_model(ARCH).eval()
    model.load_state_dict(torch.load(done.path))
    with torch.no_grad():
        assert torch.equal(model(x), _predict(engine.weights, x))
    older = export_mod.export_model(path, 1, tmp_path / "v1")
    assert (older.metadata["version"], older.metadata["round"], older.metadata["current"]) == (1, 1, False)


def test_torchscript_export_gives_the_same_predictions(state, tmp_path, digits):
    path, engine = state
    done = export_mod.export_model(path, 3, tmp_path / "ts", "torchscript")
    assert done.path.name == "model.ts"
    assert done.metadata["sha256"] == hashlib.sha256(done.path.read_bytes()).hexdigest()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates jit; the files still load
        loaded = torch.jit.load(str(done.path))
    x = torch.from_numpy(digits.test.x[:50]).float()
    with torch.no_grad():
        assert torch.equal(loaded(x), _predict(engine.served.weights, x))


def test_onnx_export_matches_torch_within_1e_5(state, tmp_path, digits):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    path, engine = state
    done = export_mod.export_model(path, 3, tmp_path / "onnx", "onnx")
    assert done.path.name == "model.onnx" and done.metadata["format"] == "onnx"
    x = digits.test.x[:64].astype(np.float32)
    session = ort.InferenceSession(str(done.path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x})[0]
    want = _predict(engine.served.weights, torch.from_numpy(x)).numpy()
    assert np.abs(got - want).max() <= 1e-5


def test_onnx_without_the_package_is_refused_with_the_extra_to_install(state, tmp_path, monkeypatch):
    path, _ = state
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a))
    with pytest.raises(StoreError, match=r"pip install edgefl\[onnx\]"):
        export_mod.export_model(path, 3, tmp_path / "o", "onnx")
    assert not (tmp_path / "o").exists()


def test_refusals_an_operator_can_act_on(state, tmp_path, capsys):
    path, _ = state
    config = _config(tmp_path, path)
    assert main(["model", "export", "--version", "9", "--config", str(config), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no model version 9" in err and "1, 2, 3 (current)" in err and len(err.strip().splitlines()) == 1
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main(["model", "export", "--config", str(config), str(busy)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert main(["model", "export", "--force", "--config", str(config), str(busy)]) == 0
    assert (busy / "keep.txt").read_text() == "mine" and (busy / "model.pt").exists()
    (tmp_path / "e").mkdir()
    assert main(["model", "list", "--config", str(_config(tmp_path / "e", tmp_path / "empty-state"))]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


def test_without_serve_average_the_last_model_is_listed_and_exported(tmp_path, digits):
    engine = _run_rounds(tmp_path / "state", digits, 0.0)
    versions, _ = export_mod.model_versions(tmp_path / "state")
    assert not any(v.served for v in versions)
    done = export_mod.export_model(tmp_path / "state", None, tmp_path / "out")
    assert done.metadata["weights"] == "last"
    model = build_model(ARCH).eval()
    model.load_state_dict(torch.load(done.path))
    x = torch.from_numpy(digits.test.x[:20]).float()
    with torch.no_grad():
        assert torch.equal(model(x), _predict(engine.weights, x))


def test_help_loads_no_torch():
    code = ("import sys\nfrom broker_coordinator.cli.cli import main\n"
            "try:\n    main(['model', 'export', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--format" in done.stdout
