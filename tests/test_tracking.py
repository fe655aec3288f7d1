"""Runs tracked where researchers look (broker_coordinator/reporting/tracking.py), read back with the
libraries' own readers: TensorBoard's EventAccumulator and an MlflowClient on a `file:` store."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.reporting.tracking import RunTracker, flatten, round_values
from broker_coordinator.settings.round_settings import RoundRecord, RoundSettings
from broker_coordinator.settings.tracking_settings import TrackingSettings
from edgefl_protocol.settings import ConfigError, build_section


def record(round_no: int, **extra) -> RoundRecord:
    r = RoundRecord(round_no, 1, 3, 4, 0.5 + 0.1 * round_no, 1.0 / round_no, 1000 * round_no, 2.5, {"late": 1},
                    "complete", "a", "b", devices={"pi-1": {"epochs": 3, "gamma": 0.25, "clipped_norm": "2 -> 1"},
                                                   "pi-2": {"epochs": 5, "ok": True}},
                    clipped={"norm": 2, "weight": 1, "direction": 1}, score=0.5 + 0.1 * round_no, bytes_down=77)
    for key, value in extra.items():
        setattr(r, key, value)
    return r


def test_a_round_becomes_named_scalars():
    values = round_values(record(2))
    assert values["global/accuracy"] == pytest.approx(0.7) and values["global/loss"] == pytest.approx(0.5)
    assert values["round/participants"] == 3 and values["round/bytes_up"] == 2000 and values["round/bytes_down"] == 77
    assert values["round/bounded"] == 3 and values["round/left_out"] == 1 and values["bounded/norm"] == 2
    assert values["round/rejected"] == 1
    assert values["device/pi-1/epochs"] == 3 and values["device/pi-1/gamma"] == 0.25
    assert "device/pi-1/clipped_norm" not in values and "device/pi-2/ok" not in values  # text and flags are no scalars
    assert "privacy/epsilon" not in values and not any(k.startswith("global/accuracy_") for k in values)
    # a privacy stage's field, under either name it may take
    assert round_values({**json.loads(json.dumps(record(1).__dict__)), "epsilon": 2.5})["privacy/epsilon"] == 2.5
    assert round_values({"round": 1, "privacy": {"epsilon": 0.75}})["privacy/epsilon"] == 0.75


def test_parameters_are_flat_strings_without_secrets():
    params = flatten({"rounds": RoundSettings(hparams={"alpha": 0.1}), "broker": {"password": "x", "port": 1883}})
    assert params["rounds.server_optimizer"] == "sgd" and params["rounds.hparams.alpha"] == "0.1"
    assert params["broker.port"] == "1883" and "broker.password" not in params


def test_tracking_settings_are_validated_naming_the_key(monkeypatch):
    with pytest.raises(ConfigError, match=r"mlflow must be a tracking URI, e.g. file:"):
        build_section(TrackingSettings, {"mlflow": "./mlruns"}, "c.toml [tracking]")
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tensorboard = 'tb' needs the tensorboard package, which is not installed: "
                                          r"pip install edgefl\[tracking\]"):
        build_section(TrackingSettings, {"tensorboard": "tb"}, "c.toml [tracking]")


def test_config_has_a_tracking_section(tmp_path):
    from broker_coordinator.settings.config import load_config
    path = tmp_path / "c.toml"
    path.write_text(f'[broker]\npassword = "p"\n[tracking]\nmlflow = "file:{tmp_path}/mlruns"\n')
    config = load_config(path, with_rounds=False)
    assert config.tracking.mlflow == f"file:{tmp_path}/mlruns" and config.tracking.enabled
    (tmp_path / "plain.toml").write_text('[broker]\npassword = "p"\n')
    assert not load_config(tmp_path / "plain.toml", with_rounds=False).tracking.enabled


def read_tensorboard(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    runs = [p for p in directory.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    events = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return events


def read_mlflow(uri: str, experiment: str, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store is opt-in
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} in {uri}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_both_sinks_hold_every_round_the_configuration_and_the_plot(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("matplotlib")
    settings = TrackingSettings(tensorboard=str(tmp_path / "tb"), mlflow=f"file:{tmp_path / 'mlruns'}", run_name="r1")
    tracker = RunTracker.start(settings, "fed", {"rounds": RoundSettings(server_optimizer="adam")})
    for n in (1, 2, 3):
        tracker.round(record(n))
    (tmp_path / "history.json").write_text("{}")
    tracker.finish([tmp_path / "history.json"], "test run")
    assert not tracker.failures

    events = read_tensorboard(tmp_path / "tb")
    assert [e.step for e in events.Scalars("global/accuracy")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("round/bytes_up")] == [1000, 2000, 3000]
    assert [e.step for e in events.Scalars("device/pi-2/epochs")] == [1, 2, 3]
    assert "configuration/text_summary" in events.Tags()["tensors"] and "plot" in events.Tags()["images"]

    client, run = read_mlflow(settings.mlflow, "fed", monkeypatch)
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert [(m.step, round(m.value, 6)) for m in client.get_metric_history(run.info.run_id, "global/accuracy")] == [
        (1, 0.6), (2, 0.7), (3, 0.8)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "round/left_out")] == [1, 2, 3]
    assert run.data.params["rounds.server_optimizer"] == "adam" and run.data.params["rounds.beta2"] == "0.99"
    assert sorted(f.path for f in client.list_artifacts(run.info.run_id)) == ["accuracy.png", "history.json"]


class Broken:
    """A sink whose disk is full from round 2 on."""
    name = "broken"

    def __init__(self):
        self.written = []

    def open(self, params):
        pass

    def scalars(self, step, values):
        if step >= 2:
            raise OSError(28, "No space left on device")
        self.written.append(step)

    def figure(self, figure, png, step):
        pass

    def files(self, paths):
        pass

    def close(self, failed):
        pass


class Slow(Broken):
    """A sink whose every write waits until the test lets it go: slower than any round."""
    name = "slow"

    def __init__(self):
        super().__init__()
        self.go = threading.Event()

    def scalars(self, step, values):
        self.go.wait(60)
        self.written.append(step)


def test_a_failing_tracker_is_logged_and_counted_and_never_stops_a_round(caplog):
    metrics = Metrics()
    broken, slow = Broken(), Slow()
    tracker = RunTracker([broken, slow], {"x": 1}, metrics)
    with caplog.at_level("WARNING"):
        for n in (1, 2, 3):
            tracker.round(record(n))
        # the rounds never wait for a sink: all three returned while the slow one still holds its first write
        assert slow.written == []
        slow.go.set()
        tracker.finish()
    assert broken.written == [1] and slow.written == [1, 2, 3]
    assert tracker.failures == {"broken": 2}
    assert metrics.registry.get_sample_value("edgefl_tracking_failures_total", {"sink": "broken"}) == 2
    assert "a write to broken failed (OSError: [Errno 28] No space left on device); the rounds go on" in caplog.text


def test_simulate_tracks_every_round_in_tensorboard_and_mlflow(tmp_path, monkeypatch):
    """One real `simulate` run (private Mosquitto, agent processes) whose tracking files open in the
    libraries' own readers with every round present."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    out, tb, uri = tmp_path / "out", tmp_path / "tb", f"file:{tmp_path / 'mlruns'}"
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--agents", "3", "--rounds", "3",
                             "--dataset", "digits", "--out", str(out), "--federation", "tracked",
                             "--server-optimizer", "momentum", "--tensorboard", str(tb), "--mlflow", uri],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tracked in TensorBoard" in result.stdout
    history = json.loads((out / "history.json").read_text())["rounds"]
    assert [r["round"] for r in history] == [1, 2, 3]

    events = read_tensorboard(tb)
    accuracy = events.Scalars("global/accuracy")
    assert [e.step for e in accuracy] == [1, 2, 3]
    assert [e.value for e in accuracy] == pytest.approx([r["accuracy"] for r in history])
    assert [e.step for e in events.Scalars("round/participants")] == [1, 2, 3]
    assert any(tag.startswith("device/dev-000/") for tag in events.Tags()["scalars"])

    client, run = read_mlflow(uri, "tracked", monkeypatch)
    for key in ("global/accuracy", "global/loss", "round/bytes_up", "round/bytes_down", "round/bounded"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2, 3], key
    params = run.data.params
    assert params["rounds.server_optimizer"] == "momentum" and params["simulation.agents"] == "3"
    assert {"accuracy.png", "history.json"} <= {f.path for f in client.list_artifacts(run.info.run_id)}
    assert run.info.status == "FINISHED"


def test_run_tracks_every_round_and_checkpoints_the_server_optimizer(tmp_path, monkeypatch):
    """`broker-coordinator run` with [tracking] and a server optimizer, against a real Mosquitto and two agents."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from broker_coordinator.access.broker import COORDINATOR_USER
    from broker_coordinator.simulation.private_broker import PrivateBroker
    from broker_coordinator.storage.store import Store
    from edgefl_protocol import signing
    from edgefl_protocol.settings import to_toml

    from .fleet import Fleet, spawn, write_test_set
    fed = "trk"
    broker = PrivateBroker(tmp_path / "broker", fed)
    broker.add_user(COORDINATOR_USER)
    for device in ("dev-0", "dev-1"):
        broker.add_user(device)
    with broker:
        fleet = Fleet(tmp_path, broker, fed, ["dev-0", "dev-1"])
        state_dir, uri = tmp_path / "state", f"file:{tmp_path / 'mlruns'}"
        config = tmp_path / "coordinator.toml"
        config.write_text(to_toml({
            "pacing": {"interval": 0, "patience": 0},  # rounds back to back, as a test wants
            "federation": {"name": fed, "model": "digits_mlp", "rounds": 3,
                           "test_data": str(write_test_set(tmp_path / "test.npz", fleet.test))},
            "broker": {"host": broker.host, "port": broker.port, "username": COORDINATOR_USER,
                       "password": broker.users[COORDINATOR_USER]},
            "rounds": {"local_epochs": 1, "min_updates": 2, "round_timeout": 30, "server_optimizer": "adam"},
            "storage": {"state_dir": str(state_dir)},
            "tracking": {"tensorboard": str(tmp_path / "tb"), "mlflow": uri, "run_name": "prod"},
        }))
        signing.write_key_file(state_dir / "device_keys.toml", fleet.keys)
        coordinator = spawn(["-m", "broker_coordinator", "run", "--config", str(config)], tmp_path / "run.log")
        try:
            assert coordinator.wait(timeout=240) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            if coordinator.poll() is None:  # exactly the process this test started
                coordinator.kill()
                coordinator.wait()
            fleet.stop()
    assert "failed" not in (tmp_path / "run.log").read_text()
    events = read_tensorboard(tmp_path / "tb")
    assert [e.step for e in events.Scalars("global/accuracy")] == [1, 2, 3]
    client, run = read_mlflow(uri, fed, monkeypatch)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "round/participants")] == [1, 2, 3]
    assert run.info.status == "FINISHED" and run.data.params["rounds.server_optimizer"] == "adam"
    assert "broker.password" not in run.data.params and run.data.params["broker.username"] == COORDINATOR_USER
    assert "accuracy.png" in {f.path for f in client.list_artifacts(run.info.run_id)}
    ckpt = Store(state_dir).load_checkpoint()
    assert ckpt.round == 3 and ckpt.server_optimizer["name"] == "adam" and ckpt.server_optimizer["steps"] == 3
    assert set(ckpt.server_optimizer["m"]) == set(ckpt.weights)
