"""Issue 13's core: models from the user's package, regression as well as classification, and
evaluation on the devices (federated evaluation and evaluation-only rounds)."""

import math
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.engine.rounds import Round
from broker_coordinator.simulation.in_memory import fold_round
from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected
from edgefl_models.architectures import ModelError, build_model, fingerprint, resolve
from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective

KEY = b"unit-test-key-0123456789abcdef01"


def _package(tmp_path, name: str, hidden: int = 8, body: str = "") -> str:
    """An installed-looking user package with a factory `build` (a tiny 1-D CNN on (3, 16) windows)."""
    root = tmp_path / f"site-{name}-{hidden}"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "model.py").write_text(textwrap.dedent(f"""
        import torch
        from torch import nn

        class Net(nn.Module):
            input_shape = (3, 16)

            def __init__(self):
                super().__init__()
                self.conv = nn.Conv1d(3, {hidden}, 3)
                self.head = nn.Linear({hidden}, 4)

            def forward(self, x):
                return self.head(torch.relu(self.conv(x)).mean(dim=2))

        def build():
            return Net()
        {body}
    """))
    sys.path.insert(0, str(root))
    return f"{name}.model:build"


@pytest.fixture
def clean_imports():
    """The tests' own packages are forgotten afterwards (and only those: torch and sklearn stay)."""
    path = list(sys.path)
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in ("ownpkg", "sensorpkg", "fppkg", "badmodel")]:
        del sys.modules[name]
    sys.path[:] = path
    resolve.cache_clear()


def test_a_factory_from_the_users_package_resolves_with_its_shape_and_outputs(tmp_path, clean_imports):
    name = _package(tmp_path, "sensorpkg")
    arch = resolve(name)
    assert arch.input_shape == (3, 16) and arch.num_classes == 4
    a, b = build_model(name, seed=3), build_model(name, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # deterministic by seed


@pytest.mark.parametrize("body,message", [
    ("", "cannot import"),
    ("def build():\n    return 42", "not a torch.nn.Module"),
    ("def build():\n    return torch.nn.Linear(3, 4)", "input_shape attribute"),
    ("def build():\n    m = torch.nn.Linear(3, 4)\n    m.input_shape = (5,)\n    return m", "forward pass"),
])
def test_an_unusable_model_name_says_what_to_do(tmp_path, clean_imports, body, message):
    if body:
        root = tmp_path / "badpkg"
        root.mkdir()
        (root / "badmodel.py").write_text("import torch\n" + body + "\n")
        sys.path.insert(0, str(root))
        name = "badmodel:build"
    else:
        name = "no_such_package_xyz.model:build"
    with pytest.raises(ModelError, match=message):
        resolve(name)
    with pytest.raises(ModelError, match="unknown model"):
        resolve("resnet9000")


def test_the_fingerprint_changes_with_the_parameters_not_their_values(tmp_path, clean_imports):
    name = _package(tmp_path, "fppkg", hidden=8)
    assert fingerprint(build_model(name, 1)) == fingerprint(build_model(name, 2))
    assert fingerprint(build_model(name)) != fingerprint(build_model("digits_mlp"))


def test_regression_objective_trains_and_reports_its_error():
    mse, mae = Objective.of("regression"), Objective.of("regression", "mae")
    assert (mse.metric, mae.metric, mse.higher_is_better) == ("mse", "mae", False)
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0]]))
        model.bias.zero_()
    x = np.array([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0]], dtype=np.float32)
    data = Dataset(x, np.array([1.0, 2.0, 5.0], dtype=np.float32))
    assert mse.evaluate(model, data).score == pytest.approx(4 / 3)
    assert mae.evaluate(model, data).score == pytest.approx(2 / 3)
    assert math.isnan(mse.evaluate(model, Dataset(x[:0], data.y[:0])).score)
    with pytest.raises(ValueError, match="regression task trains with mse or mae"):
        Objective("regression", "cross_entropy")
    with pytest.raises(ValueError, match="task must be one of"):
        Objective.of("ranking")


def test_tasks_name_the_objective_and_older_tasks_default_to_classification():
    task = messages.Task(3, 2, time.time() + 5, "fedavg", {}, {}, "float32", 1, "regression", "mae", True, False)
    again = messages.decode_task(messages.encode("task", task))
    assert (again.task, again.loss, again.evaluate, again.train) == ("regression", "mae", True, False)
    import msgpack
    old = msgpack.unpackb(messages.encode("task", task))
    for key in ("task", "loss", "evaluate", "train"):
        del old[key]
    legacy = messages.decode_task(msgpack.packb(old))
    assert (legacy.task, legacy.loss, legacy.evaluate, legacy.train) == ("classification", "cross_entropy", False, True)
    old["train"] = "yes"
    with pytest.raises(Rejected, match="'train'"):
        messages.decode_task(msgpack.packb(old))


def test_evaluation_reports_are_signed_and_checked():
    report = messages.EvalReport("d1", 4, 1, 3, "mse", 0.5, 0.5, 12, "u")
    decoded = messages.decode_answer(messages.encode_report(report, KEY), 4096, KEY, "d1")
    assert decoded == report
    with pytest.raises(Rejected, match="signature"):
        messages.decode_answer(messages.encode_report(report, KEY), 4096, b"x" * 32, "d1")
    for bad, reason in ((dict(count=0), "schema"), (dict(score=float("nan")), "non_finite")):
        tampered = messages.EvalReport(**{**report.__dict__, **bad})
        with pytest.raises(Rejected) as exc:
            messages.decode_answer(messages.encode_report(tampered, KEY), 4096, KEY, "d1")
        assert exc.value.reason == reason


def _coordinator(tmp_path, objective=Objective(), test=True, **settings):
    from broker_coordinator.engine.loop import Engine
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.storage.store import Store
    from edgefl_models import datasets

    test_set = datasets.load("digits").test if test else None
    return Engine("u", "digits_mlp", test_set, RoundSettings(codec="float32", **settings), store=Store(tmp_path),
                       device_keys={d: KEY for d in ("d1", "d2", "d3")}, objective=objective)


def _update(c, device, metrics, round_no=1):
    import msgpack

    tensors = {k: np.zeros_like(v) for k, v in c.weights.items()}
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    return messages.encode_update(messages.Update(device, round_no, 0, 10, {"steps": 1, **metrics}, body,
                                                  "float32", specs, "u"), KEY)


def test_without_a_test_set_the_round_records_the_devices_sample_weighted_score(tmp_path):
    c = _coordinator(tmp_path, test=False)
    assert (c.evaluate_central, c.evaluate_devices) == (False, True)
    record = fold_round(c, {
        "d1": _update(c, "d1", {"eval_metric": "accuracy", "eval_score": 0.5, "eval_loss": 1.0, "eval_count": 10}),
        "d2": _update(c, "d2", {"eval_metric": "accuracy", "eval_score": 0.8, "eval_loss": 0.4, "eval_count": 30}),
        "d3": _update(c, "d3", {"eval_metric": "mse", "eval_score": 0.1, "eval_loss": 0.1, "eval_count": 1000}),
    })
    assert record.metric == "accuracy" and math.isnan(record.score) and math.isnan(record.accuracy)
    assert record.federated["score"] == pytest.approx((0.5 * 10 + 0.8 * 30) / 40)  # d3 measured something else
    assert record.federated["count"] == 40 and record.federated["devices"] == 2
    assert record.participants == 3  # its update still counts; only its evaluation is left out
    row = c.store.rounds()[-1]
    assert row["metric"] == "accuracy" and '"count": 40' in row["federated"]


def test_an_evaluation_only_round_keeps_the_model_and_takes_reports_not_updates(tmp_path):
    c = _coordinator(tmp_path, objective=Objective.of("classification"), eval_only_every=2)
    rnd = Round(2, 1, {"d1", "d2", "d3"}, time.time() + 60, 0, RobustRound(c.specs, c.norm_bound), train=False)
    c.intake.on_update(rnd, "d1", messages.encode_report(messages.EvalReport("d1", 2, 1, 0, "accuracy", 0.9, 0.3, 20, "u"),
                                                   KEY), time.time())
    c.intake.on_update(rnd, "d2", _update(c, "d2", {}, round_no=2), time.time())  # an update is not what was asked
    c.intake.on_update(rnd, "d3", messages.encode_report(messages.EvalReport("d3", 2, 1, 0, "mse", 0.9, 0.3, 20, "u"),
                                                   KEY), time.time())  # the wrong metric
    assert rnd.evaluations == {"d1": (0.9, 0.3, 20)} and c.intake.rejections["schema"] == 2
    assert c.settings.evaluation_only(2) and not c.settings.evaluation_only(3)
    weights = {k: v.copy() for k, v in c.weights.items()}
    from broker_coordinator.engine.rounds import RoundState
    rnd.move(RoundState.COLLECTING)
    rnd.move(RoundState.CLOSED)
    record = c.conclude(rnd, "base")
    assert record.kind == "evaluate" and record.closed == "evaluated" and c.version == 0
    assert all(np.array_equal(weights[k], c.weights[k]) for k in weights)
    assert record.federated["score"] == pytest.approx(0.9) and record.participants == 1


def test_central_evaluation_without_a_test_set_is_a_config_error(tmp_path):
    from broker_coordinator.settings.round_settings import RoundSettings
    with pytest.raises(ValueError, match="needs a test set"):
        RoundSettings(evaluate="central").evaluation(False)
    with pytest.raises(ValueError, match="evaluate must be one of"):
        RoundSettings(evaluate="sometimes").validate()
    assert RoundSettings(evaluate="both").evaluation(True) == (True, True)


def _digits_package(root, hidden: int) -> None:
    """A user package whose installed version decides the hidden width (the same name, another model)."""
    (root / "ownpkg").mkdir(parents=True)
    (root / "ownpkg" / "__init__.py").write_text("")
    (root / "ownpkg" / "model.py").write_text(textwrap.dedent(f"""
        from torch import nn

        def build():
            model = nn.Sequential(nn.Linear(64, {hidden}), nn.ReLU(), nn.Linear({hidden}, 10))
            model.input_shape = (64,)
            return model
    """))


@pytest.mark.parametrize("agents_have,reason", [(16, "model_mismatch"), (None, "unknown_model")])
def test_devices_whose_installed_model_differs_refuse_with_one_line(tmp_path, monkeypatch, clean_imports,
                                                                    agents_have, reason):
    """Through real agent processes and a real broker: the coordinator's package builds a 32-wide
    model; the devices have another version of it (or none). Each refuses with one log line and
    the coordinator records why; nothing crashes and no round is aggregated."""
    from broker_coordinator.engine.rounds import RoundFailed
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.simulation.simulate import SimulationSpec, simulate
    from broker_coordinator.storage.store import Store

    _digits_package(tmp_path / "coordinator-site", 32)
    sys.path.insert(0, str(tmp_path / "coordinator-site"))
    if agents_have:
        _digits_package(tmp_path / "device-site", agents_have)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "device-site"))
    spec = SimulationSpec(agents=2, rounds=1, dataset="digits", partition="iid", out=tmp_path / "out",
                          model="ownpkg.model:build")
    with pytest.raises(RoundFailed, match=reason):
        simulate(spec, RoundSettings(round_timeout=30, max_attempts=1), echo=lambda line: None)
    for device in ("dev-000", "dev-001"):
        log = (tmp_path / "out" / "run" / "devices" / device / "agent.log").read_text()
        lines = [line for line in log.splitlines() if "refusing the task" in line]
        assert len(lines) == 1 and reason in lines[0], log
        assert "Traceback" not in log
    store = Store(tmp_path / "out" / "run" / "coordinator")
    rounds = store.rounds()
    assert [r["closed"] for r in rounds] == ["abandoned"] and "refused the task" in rounds[0]["reason"]
    assert store.load_checkpoint() is None  # nothing was aggregated


def test_devices_with_broken_data_refuse_each_round_while_the_others_train_and_evaluate(tmp_path):
    """Four devices with their own files and no central test set: two good, one whose samples have
    the wrong shape and one with NaN. Every round the broken two refuse with a reason (one log line
    each), the good two train and evaluate on their held-out slices, and every agent keeps running."""
    import json
    import subprocess

    from edgefl_models import datasets

    digits = datasets.load("digits").train
    devices = tmp_path / "devices"
    devices.mkdir()
    files = {"good-0": digits.subset(np.arange(0, 600)), "good-1": digits.subset(np.arange(600, 1200)),
             "shape": Dataset(digits.x[:300].reshape(-1, 8, 8), digits.y[:300]),
             "nan": Dataset(np.where(np.arange(64) == 3, np.nan, digits.x[:300]).astype(np.float32), digits.y[:300])}
    for name, data in files.items():
        datasets.save_npz(tmp_path / f"{name}.npz", data)
        (devices / f"{name}.toml").write_text(f'[data]\nsource = "npz"\npath = "{tmp_path / name}.npz"\n'
                                              'holdout = 0.2\n')
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--model", "digits_mlp",
                             "--devices-dir", str(devices), "--rounds", "2", "--round-timeout", "60",
                             "--local-epochs", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exited" not in result.stdout  # no agent process died
    rounds = json.loads((out / "history.json").read_text())["rounds"]
    assert [r["participants"] for r in rounds] == [2, 2]
    for r in rounds:
        assert set(r["refused"]) == {"shape", "nan"} and r["metric"] == "accuracy" and math.isnan(r["score"])
        # a stable hash draw of about 20% of the good devices' 2 x 600 samples
        assert r["federated"]["devices"] == 2 and 200 < r["federated"]["count"] < 280
    assert rounds[1]["federated"]["score"] > rounds[0]["federated"]["score"]  # round 1 measured the initial model
    for name, why in (("shape", "expects (64,)"), ("nan", "NaN")):
        log = (out / "run" / "devices" / name / "agent.log").read_text()
        refusals = [line for line in log.splitlines() if "refusing the task" in line]
        assert len(refusals) == 2 and all(why in line for line in refusals), log
        assert "Traceback" not in log
