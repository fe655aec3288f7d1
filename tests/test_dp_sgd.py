"""Sample-level DP-SGD on the device (`[privacy] device = "dp-sgd"`, edge_agent/dp_sgd.py): the loop's
privatized step, the device's accountant, the refusals, and a federation through a real broker."""

import math

import numpy as np
import pytest
import torch

from broker_coordinator.settings.config import ConfigError, load_config
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_settings import RoundSettings
from edge_agent import dp_sgd
from edge_agent.agent import local_settings
from edge_agent.training import LocalSettings, train_locally
from edgefl_protocol import algorithms
from edgefl_protocol.errors import Rejected
from edgefl_models import datasets
from edgefl_models.architectures import build_model
from .fleet import simulate_with_config

pytest.importorskip("opacus")


def _train(dp: dp_sgd.DeviceDP | None, seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = build_model("digits_mlp")
    data = datasets.load("digits").train.subset(np.arange(64))
    settings = LocalSettings(epochs=1, batch_size=16, lr=1.0, weight_decay=0.0, grad_clip=0.0, dp=dp)
    rule = algorithms.get("fedavg").client({}, {}, {}, {})
    return train_locally(model, data, rule, settings, seed).delta


def _norm(delta: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in delta.values()))


def test_each_example_moves_a_step_by_at_most_the_clip():
    clip = 0.01
    private = _train(dp_sgd.DeviceDP(noise_multiplier=1e-6, clip=clip, delta=1e-5))
    # 4 steps of lr 1: each the mean of 16 gradients clipped to `clip`, so at most `clip` long
    assert _norm(private) <= 4 * clip * 1.001
    assert _norm(_train(None)) > 20 * _norm(private)  # without it the same steps go much further


def test_the_noise_is_fresh_every_round_while_the_data_order_is_the_seed_s():
    dp = dp_sgd.DeviceDP(noise_multiplier=1.0, clip=0.1, delta=1e-5)
    first, again = _train(dp), _train(dp)
    assert not all(np.array_equal(first[k], again[k]) for k in first)  # CSPRNG-seeded noise
    plain, plain_again = _train(None), _train(None)
    assert all(np.array_equal(plain[k], plain_again[k]) for k in plain)


def test_the_device_epsilon_grows_with_its_steps_and_agrees_with_dp_accounting():
    dp_accounting = pytest.importorskip("dp_accounting")
    dp = dp_sgd.DeviceDP(noise_multiplier=1.1, clip=1.0, delta=1e-5)
    ledger: list = []
    first = dp_sgd.spend(ledger, dp, 0.02, 500)
    second = dp_sgd.spend(ledger, dp, 0.02, 500)
    assert 0 < first < second
    # the same 1,000 Poisson-subsampled Gaussian steps through Google's RDP accountant
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        0.02, dp_accounting.GaussianDpEvent(1.1)), 1000)
    assert second == pytest.approx(accountant.get_epsilon(1e-5), rel=0.05)


def test_a_device_that_cannot_run_it_refuses_with_the_reason(monkeypatch):
    assert "torch >= 2.6" in dp_sgd.unavailable("1.13.1")
    assert dp_sgd.unavailable() is None  # this machine's torch and Opacus can
    hp = {"dp_sgd_noise": 1.0, "dp_sgd_clip": 1.0, "dp_sgd_delta": 1e-5}
    assert local_settings(hp).dp == dp_sgd.DeviceDP(1.0, 1.0, 1e-5)
    monkeypatch.setattr(dp_sgd, "unavailable", lambda: "needs Opacus on the device")
    with pytest.raises(Rejected) as refused:
        local_settings(hp)
    assert refused.value.reason == dp_sgd.UNAVAILABLE and "Opacus" in refused.value.detail
    with pytest.raises(Rejected, match="dp-sgd needs noise > 0"):
        dp_sgd.from_task({**hp, "dp_sgd_noise": 0.0})


def _config(tmp_path, algorithm: str, extra: str = "") -> object:
    path = tmp_path / "coordinator.toml"
    path.write_text(f'[broker]\npassword = "x"\n[rounds]\nalgorithm = "{algorithm}"\n'
                    f'[privacy]\ndevice = "dp-sgd"\n{extra}')
    return path


def test_config_load_refuses_the_sam_family_and_bad_values_and_tasks_carry_the_settings(tmp_path):
    with pytest.raises(ConfigError, match="privacy device dp-sgd \\+ a SAM-family algorithm is refused \\(not built"):
        load_config(_config(tmp_path, "dynsam"))
    with pytest.raises(ConfigError, match="device_clip must be in \\(0, 1e6\\)"):
        load_config(_config(tmp_path, "fedavg", "device_clip = 0\n"))
    settings = RoundSettings(algorithm="fedprox", privacy=PrivacySettings(device="dp-sgd", device_noise_multiplier=0.8))
    settings.validate()
    hp = settings.task_hparams(1)
    assert (hp["dp_sgd_noise"], hp["dp_sgd_clip"], hp["dp_sgd_delta"]) == (0.8, 1.0, 1e-5)
    assert "dp_sgd_clip" not in RoundSettings(algorithm="fedavg").task_hparams(1)


def test_simulate_with_dp_sgd_devices_reports_their_epsilon(tmp_path):
    result, rounds = simulate_with_config(tmp_path, '[rounds]\nalgorithm = "fedavg"\nclients_per_round = 3\n'
                                          'local_epochs = 1\n[privacy]\ndevice = "dp-sgd"\n'
                                          'device_noise_multiplier = 1.0\ndevice_clip = 1.0\n')
    assert [r["participants"] for r in rounds] == [3, 3], result.stdout
    first, second = ({d: m["dp_epsilon"] for d, m in r["devices"].items()} for r in rounds)
    assert set(first) == set(second) and all(0 < first[d] < second[d] for d in first)  # never refunded


def test_status_shows_each_device_s_own_epsilon(tmp_path):
    from broker_coordinator.cli.service import status
    from broker_coordinator.storage.store import Store
    from edgefl_protocol.settings import to_toml
    store = Store(tmp_path / "state")
    store.record_presence("dev-a", True, {"dp_epsilon": 1.25, "threads": 1})
    store.record_presence("dev-b", True, {"threads": 1})
    store.close()
    config = tmp_path / "c.toml"
    config.write_text(to_toml({"federation": {"name": "f", "model": "digits_mlp", "test_data": "unused.npz"},
                               "broker": {"password": "x"}, "storage": {"state_dir": str(tmp_path / "state")}}))
    lines: list[str] = []
    status(load_config(config, with_rounds=False), lines.append)
    assert "its own DP-SGD epsilon 1.25" in next(line for line in lines if "dev-a" in line)
    assert "epsilon" not in next(line for line in lines if "dev-b" in line)


def test_rounds_at_the_same_noise_and_rate_share_one_ledger_row():
    dp = dp_sgd.DeviceDP(noise_multiplier=1.1, clip=1.0, delta=1e-5)
    ledger: list = []
    for _ in range(3):
        dp_sgd.spend(ledger, dp, 0.02, 100)
    dp_sgd.spend(ledger, dp, 0.05, 10)
    assert ledger == [[1.1, 0.02, 300], [1.1, 0.05, 10]]
    assert dp_sgd.epsilon(ledger, 1e-5) == pytest.approx(dp_sgd.epsilon([[1.1, 0.02, 100]] * 3 + [[1.1, 0.05, 10]], 1e-5))
