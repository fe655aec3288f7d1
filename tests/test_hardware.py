from types import SimpleNamespace

import psutil
import pytest
import torch

from edge_agent import hardware
from edge_agent.hardware import MAX_EPOCHS, MIN_EPOCHS, calibrate, default_threads, plan_epochs, probe
from edgefl_models.architectures import ARCHITECTURES, build_model


def test_probe_reports_the_basics():
    profile = probe()
    assert profile["cores"] >= 1 and profile["memory_mb"] > 0


def _missing(error: Exception):
    def probe_fails(*args, **kwargs):
        raise error
    return probe_fails


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory", "/sys/class/power_supply"),
                                   NotImplementedError("no sensors on this platform"), PermissionError(13, "denied")])
def test_probe_survives_a_board_without_battery_thermal_zone_or_cpufreq(monkeypatch, error):
    # a Pi in a container or a minimal image: each sensor missing in the way psutil reports it
    for name in ("sensors_battery", "sensors_temperatures", "cpu_freq"):
        monkeypatch.setattr(psutil, name, _missing(error))
    profile = probe()
    assert profile["cores"] >= 1 and profile["memory_mb"] > 0
    assert not {"battery_percent", "on_power", "temperature_c", "cpu_mhz_max"} & set(profile)


def test_probe_survives_every_reading_missing(monkeypatch):
    for name in ("sensors_battery", "sensors_temperatures", "cpu_freq", "virtual_memory", "cpu_count"):
        monkeypatch.setattr(psutil, name, _missing(FileNotFoundError(2, "missing")))
    monkeypatch.setattr(hardware.os, "getloadavg", _missing(OSError("no load average")))
    assert probe() == {"cores": 1}


def test_probe_reports_battery_and_temperature_where_the_board_has_them(monkeypatch):
    battery = SimpleNamespace(percent=80.04, secsleft=100, power_plugged=False)
    temp = SimpleNamespace(label="cpu", current=51.23, high=None, critical=None)
    monkeypatch.setattr(psutil, "sensors_battery", lambda: battery)
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {"cpu_thermal": [temp]})
    profile = probe()
    assert (profile["battery_percent"], profile["on_power"], profile["temperature_c"]) == (80.0, False, 51.2)


def test_default_threads_leaves_one_core_free():
    assert [default_threads(cores) for cores in (1, 2, 4)] == [1, 1, 3]


def test_default_threads_is_one_for_a_cuda_build_on_an_armv8_0_core(monkeypatch):
    # PyPI's aarch64 CUDA wheel SIGILLs in threaded BLAS on a Pi 4 (no LSE atomics)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(hardware, "_aarch64_without_atomics", lambda: True)
    assert default_threads(4) == 1
    monkeypatch.setattr(hardware, "_aarch64_without_atomics", lambda: False)
    assert default_threads(4) == 3


def test_calibration_measures_a_positive_speed():
    arch = ARCHITECTURES["digits_mlp"]
    assert calibrate(build_model("digits_mlp"), arch.input_shape, seconds=0.1) > 0


def test_epochs_follow_speed_between_three_and_eight():
    weak = plan_epochs(100, 500, seconds_left=1e6)
    strong = plan_epochs(10_000, 500, seconds_left=1e6)
    middle = plan_epochs(1000, 500, seconds_left=1e6)
    assert (weak.epochs, strong.epochs) == (MIN_EPOCHS, MAX_EPOCHS)
    assert MIN_EPOCHS < middle.epochs < MAX_EPOCHS


def test_high_tau_halves_epochs():
    plan = plan_epochs(10_000, 500, seconds_left=1e6, tau=0.3)
    assert plan.epochs == MAX_EPOCHS // 2 and "halved" in plan.reason


def test_deadline_caps_epochs_but_never_below_one():
    # 1000 samples at 1000 samples/s with 2 passes per step = 2 s per epoch; 10 s left * 0.7 margin -> 3 epochs
    plan = plan_epochs(1000, 1000, seconds_left=10, passes_per_step=2)
    assert plan.epochs == 3 and "deadline" in plan.reason
    assert plan_epochs(10, 10_000, seconds_left=1).epochs == 1
