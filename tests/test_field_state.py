"""State a device and the server must agree on follows what the server received (issue 11):
FedDyn's dual from the decoded delta, error feedback when an update never arrives, and
algorithm tensors (extra.*) through the lossy codec without error feedback."""

import numpy as np
import torch
from torch import nn

from edge_agent.settlement import owed
from edge_agent.training import LocalSettings, train_locally
from edgefl_protocol import algorithms, codec
from edgefl_models.architectures import get_weights, set_weights
from edgefl_models.datasets import Dataset


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))


def data(seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset(rng.standard_normal((48, 20)).astype(np.float32), rng.integers(0, 3, 48).astype(np.int64))


def rounds_of(name: str, lossy: str, rounds: int = 3, commit: bool = True):
    """One client, population one: the server's H is the sum of what it decoded."""
    algorithm = algorithms.get(name)
    server = algorithm.server({})
    net, state, residual = model(), {}, None
    weights = get_weights(net)
    for round_no in range(1, rounds + 1):
        set_weights(net, weights)
        rule = algorithm.client({}, {}, state)
        result = train_locally(net, data(round_no), rule, LocalSettings(epochs=1, batch_size=16), round_no)
        encoded = codec.encode(result.delta, lossy, residual, np.random.default_rng(round_no))
        residual = encoded.residual
        received = codec.decode(encoded.codec, encoded.specs, encoded.body, None, 10**6)
        if commit:
            rule.committed(received)
        server.start_round(round_no, 1)
        server.observe("d", 48, result.metrics)
        weights = server.new_global(weights, received)
    return state, server


def test_the_feddyn_dual_is_the_sum_of_what_the_server_received():
    for name in ("feddyn", "dynsam"):
        state, server = rounds_of(name, codec.DEFAULT)
        for h, (param, total) in zip(state["h"], server.H.items()):
            np.testing.assert_allclose(h, total, atol=1e-5, err_msg=f"{name} {param}")


def test_without_the_commit_the_two_sides_drift_apart_under_a_lossy_codec():
    state, server = rounds_of("feddyn", codec.DEFAULT, commit=False)
    gap = max(float(np.abs(h - total).max()) for h, total in zip(state["h"], server.H.values()))
    assert gap > 1e-3


def test_float32_needs_no_correction():
    state, server = rounds_of("feddyn", "float32", commit=False)
    for h, total in zip(state["h"], server.H.values()):
        np.testing.assert_allclose(h, total, atol=1e-5)


def test_an_undelivered_update_is_owed_in_full():
    delta = {"w": np.array([1.0, 2.0], np.float32), "extra.mu.w": np.array([5.0, 5.0], np.float32)}
    residual = {"w": np.array([0.5, 0.0], np.float32)}
    got = owed(delta, residual)
    assert set(got) == {"w"} and np.allclose(got["w"], [1.5, 2.0])
    assert np.allclose(owed(delta, None)["w"], [1.0, 2.0])


def test_fedsmoo_mu_travels_lossy_and_small():
    rng = np.random.default_rng(0)
    tensors = {"w": rng.normal(0, 0.01, 80_000).astype(np.float32),
               "extra.mu.w": rng.normal(0, 0.01, 80_000).astype(np.float32)}
    lossy = codec.encode(tensors, codec.DEFAULT)
    exact = codec.encode({"w": tensors["w"]}, codec.DEFAULT)
    assert len(lossy.body) < 2.2 * len(exact.body)  # mu costs about as much as the delta, not 30x
    assert set(lossy.residual) == {"w"}  # no error feedback for state
