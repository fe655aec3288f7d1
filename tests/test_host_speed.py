"""bench/host_speed.py: the benchmarks' emulated devices plan their epochs from a pinned host speed,
so a rerun in another process (another load, another machine) plans the same epochs. Units."""

import json
import logging

import pytest

from bench import host_speed, inmemory


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(inmemory, "_host_speed", {})


def test_a_pinned_speed_is_used_without_calibrating(tmp_path, monkeypatch, fresh):
    path = tmp_path / "host_speed.json"
    path.write_text(json.dumps({"samples_per_cpu_s": {"digits_mlp": 12345.0}}))
    monkeypatch.setattr(host_speed, "PINNED", path)

    def no_calibration(arch):
        raise AssertionError(f"calibrated {arch} although it is pinned")

    monkeypatch.setattr(host_speed, "calibrate", no_calibration)
    assert inmemory.host_speed("digits_mlp") == 12345.0


def test_an_unpinned_model_is_calibrated_once_with_a_warning(tmp_path, monkeypatch, fresh, caplog):
    monkeypatch.setattr(host_speed, "PINNED", tmp_path / "absent.json")
    calls = []
    monkeypatch.setattr(host_speed, "calibrate", lambda arch: calls.append(arch) or 777.0)
    with caplog.at_level(logging.WARNING):
        assert inmemory.host_speed("logreg60") == 777.0
        assert inmemory.host_speed("logreg60") == 777.0
    assert calls == ["logreg60"]
    assert "no pinned host speed for logreg60" in caplog.text


def test_a_broken_pin_file_says_what_to_do(tmp_path):
    path = tmp_path / "host_speed.json"
    path.write_text('{"speeds": 3}')
    with pytest.raises(ValueError, match="python -m bench.host_speed --pin"):
        host_speed.pinned(path)


def test_pin_writes_what_pinned_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(host_speed, "calibrate", lambda arch: {"a": 10.0, "b": 20.0}[arch])
    out = host_speed.pin(["a", "b"], tmp_path / "pin.json")
    assert host_speed.pinned(tmp_path / "pin.json") == {"a": 10.0, "b": 20.0} == out["samples_per_cpu_s"]
    assert out["measured"]["torch"]


def test_the_committed_pin_covers_every_built_in_model():
    from edgefl_models.architectures import ARCHITECTURES
    assert set(ARCHITECTURES) <= set(host_speed.pinned())
