"""The algorithms' math against hand-computed values, on tiny models."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from edge_agent.state import DeviceState
from edge_agent.training import LocalSettings, train_locally
from edgefl_protocol import algorithms
from edgefl_protocol.algorithms import drsam, dynsam, feddyn, fedprox, fedsam, fedsmoo
from edgefl_protocol.algorithms.base import cosine
from edgefl_protocol.errors import Rejected
from edgefl_models.datasets import Dataset

H = {k: float(v) for k, v in drsam.DEFAULT_HPARAMS.items() if k != "weighting"}


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def tiny_data(n: int = 16, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset(rng.standard_normal((n, 4)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64))


def t(*values: float) -> list[torch.Tensor]:
    return [torch.tensor(values, dtype=torch.float32)]


def params_with_grad(values, grads) -> list[torch.Tensor]:
    p = torch.tensor(values, dtype=torch.float32, requires_grad=True)
    p.grad = torch.tensor(grads, dtype=torch.float32)
    return [p]


# --- DR-SAM signals and strengths ------------------------------------------------------
def test_lambda_is_clipped_and_rho_shrinks_with_it():
    lambda_raw, lam, rho = drsam.strengths(gamma=0.5, sigma=0.2, tau=0.1, rho_max_k=0.05, h=H)
    assert lambda_raw == pytest.approx(0.4 * 0.5 + 0.5 * 0.2 + 0.1 * 0.1)  # 0.31
    assert lam == 0.3 and rho == pytest.approx(0.05 * math.exp(-0.3))
    lambda_raw, lam, rho = drsam.strengths(1.0, 0.0, 0.0, 0.05, H)
    assert lambda_raw == 0 and lam == 0.01 and rho == pytest.approx(0.05 * math.exp(-0.01))
    assert drsam.strengths(0.9, 0.1, 0.0, 0.05, H)[1] == pytest.approx(0.09)  # inside the range: unchanged
    assert drsam.strengths(1.0, 0.0, 0.0, 0.0001, H)[2] == 0.001  # rho_min


def test_sigma_clamp_and_noise_threshold():
    assert drsam.clean_sigma(-0.02, loss=1.0) == 0.0
    assert drsam.clean_sigma(0.005, loss=1.0) == 0.0  # below 1% of L(theta): noise
    assert drsam.clean_sigma(0.02, loss=1.0) == 0.02
    assert drsam.clean_sigma(0.02, loss=3.0) == 0.0


def test_per_client_rho_max_ratio_and_clamp():
    assert drsam.per_client_rho_max(0.05, 0.2, 0.1, 0.25, 4) == pytest.approx(0.1)
    assert drsam.per_client_rho_max(0.05, 1.0, 0.1, 0.25, 4) == pytest.approx(0.2)     # ratio 10 -> 4
    assert drsam.per_client_rho_max(0.05, 0.01, 1.0, 0.25, 4) == pytest.approx(0.0125)  # ratio 0.01 -> 0.25
    assert drsam.per_client_rho_max(0.05, 0.2, 0.0, 0.25, 4) == 0.05                   # sigma_bar 0 keeps rho_max
    assert drsam.per_client_rho_max(0.05, 0.0, 0.3, 0.25, 4) == 0.05                   # no median yet


def test_gamma_from_first_and_last_m_gradients():
    s = drsam.Signals(m=2, total_steps=6)
    for step, g in [(0, (1.0, 0.0)), (1, (1.0, 0.0)), (2, (9.0, 9.0)), (3, (9.0, 9.0)), (4, (0.0, 1.0)), (5, (1.0, 1.0))]:
        if s.in_first(step) or s.in_last(step):
            s.add_gradient(step, t(*g))
    g_ref, g_fin = s.g_ref(), s.g_fin()
    assert torch.equal(g_ref[0], torch.tensor([1.0, 0.0])) and torch.equal(g_fin[0], torch.tensor([0.5, 1.0]))
    assert cosine(g_fin, g_ref) == pytest.approx(0.5 / math.sqrt(1.25))
    assert cosine(g_fin, g_ref, b_norm=2.0) == pytest.approx(0.5 / (math.sqrt(1.25) * 2.0))  # dynamic baseline
    assert drsam.Signals(m=5, total_steps=4).m == 2  # short rounds: first and last m never overlap


def test_tau_is_std_of_the_angle_queue():
    assert drsam.tau_of([]) == 0 and drsam.tau_of([0.7]) == 0
    assert drsam.tau_of([0.1, 0.3]) == pytest.approx(0.1)
    assert drsam.angle(t(1.0, 0.0), t(0.0, 2.0)) == pytest.approx(math.pi / 2)


def new_drsam_client(state: dict, broadcast: dict | None = None, total_steps: int = 10, **hparams) -> drsam.Client:
    client = drsam.Client({**drsam.DEFAULT_HPARAMS, **hparams}, broadcast or {"round": 5, "warmup": False}, state)
    client.begin(tiny_model(), [torch.zeros(3, 4), torch.zeros(3)], total_steps, 16)
    return client


def test_negative_sigma_remeasures_along_a_random_direction():
    state = {"gamma": 0.5, "tau": 0.0, "lambda": 0.1, "rho": 0.04}
    client = new_drsam_client(state)
    assert client.lam == 0.1 and client.rho == 0.04  # first m steps: previous participation's values
    for step in range(5):
        client.observe_perturbed(step, loss=1.0, loss_perturbed=0.9)  # raw sigma = -0.1 < -0.05
    assert client.recalibrate_at == 5 and client.sigma is None
    grads = [torch.ones(3, 4), torch.ones(3)]
    direction = client.ascent_direction(5, grads)
    assert not torch.allclose(direction[0], grads[0])  # random, not the gradient
    client.observe_perturbed(5, loss=1.0, loss_perturbed=1.3)
    assert client.sigma == pytest.approx(0.3)
    assert client.lambda_raw == pytest.approx(0.4 * 0.5 + 0.5 * 0.3)
    assert client.lam == 0.3 and client.rho == pytest.approx(0.05 * math.exp(-0.3))


def test_strengths_are_recomputed_after_step_m_from_this_rounds_sigma():
    client = new_drsam_client({"gamma": 0.8, "tau": 0.2})
    assert client.lam == 0.0 and client.rho == 0.05  # first participation: warm-up values
    for step, diff in enumerate([0.1, 0.2, 0.3, 0.2, 0.2]):
        client.observe_perturbed(step, loss=2.0, loss_perturbed=2.0 + diff)
    assert client.sigma == pytest.approx(0.2)
    assert client.lambda_raw == pytest.approx(0.4 * 0.2 + 0.5 * 0.2 + 0.1 * 0.2)


def test_folded_gradient_is_g_sam_plus_two_lambda_times_drift():
    client = new_drsam_client({"lambda": 0.2, "rho": 0.03})
    params = [torch.full((3, 4), 0.5, requires_grad=True), torch.full((3,), -1.0, requires_grad=True)]
    g_sam = [torch.arange(12.0).reshape(3, 4), torch.ones(3)]
    for p, g in zip(params, g_sam):
        p.grad = g.clone()
    client.adjust_gradients(3, params)
    assert torch.allclose(params[0].grad, g_sam[0] + 2 * 0.2 * 0.5)
    assert torch.allclose(params[1].grad, g_sam[1] + 2 * 0.2 * -1.0)


def test_folded_gradient_in_the_loop_is_what_clipping_sees(monkeypatch):
    seen = []
    original_clip = nn.utils.clip_grad_norm_

    def spy(params, max_norm):
        seen.append([p.grad.clone() for p in params])
        return original_clip(params, max_norm)

    monkeypatch.setattr(nn.utils, "clip_grad_norm_", spy)
    model = tiny_model()
    rule = drsam.Client(drsam.DEFAULT_HPARAMS, {"round": 5, "warmup": False}, {"lambda": 0.2, "rho": 0.03})
    folded = []
    adjust = rule.adjust_gradients

    def record(step, params):
        before = [p.grad.clone() for p in params]
        adjust(step, params)
        expected = [b + 2 * rule.lam * (p.detach() - g) for b, p, g in zip(before, params, rule.global_params)]
        folded.append((expected, [p.grad.clone() for p in params]))

    rule.adjust_gradients = record
    train_locally(model, tiny_data(32), rule, LocalSettings(epochs=1, batch_size=8), seed=0)
    assert len(folded) == 4 and len(seen) == 4
    for (expected, actual), clipped_input in zip(folded, seen):
        for e, a, c in zip(expected, actual, clipped_input):
            assert torch.allclose(e, a, atol=1e-6) and torch.equal(a, c)


def test_warmup_gives_exactly_fedavgs_local_update():
    settings = LocalSettings(epochs=2, batch_size=4, momentum=0.9)
    fedavg = train_locally(tiny_model(), tiny_data(), algorithms.get("fedavg").client({}, {}, {}), settings, 3)
    warm = drsam.Client(drsam.DEFAULT_HPARAMS, {"round": 1, "warmup": True}, {})
    result = train_locally(tiny_model(), tiny_data(), warm, settings, 3)
    for name in fedavg.delta:
        assert np.array_equal(fedavg.delta[name], result.delta[name])
    assert result.metrics["gamma"] == 1.0 and result.metrics["lambda"] == 0.0
    assert result.metrics["passes"] == fedavg.metrics["passes"]  # no SAM pass during warm-up


def test_smoothness_ratio_and_rho_max_from_it():
    # gradient of 0.5 * 4 * w^2 is 4w: moving w from (1, 0) to (0.5, 0.5) changes it by 4x as much
    before, after = t(1.0, 0.0), t(0.5, 0.5)
    ratio = drsam.smoothness_ratio(before, [4 * x for x in before], after, [4 * x for x in after])
    assert ratio == pytest.approx(4.0)
    assert drsam.smoothness_ratio(before, before, before, before) is None  # theta did not move
    assert drsam.rho_max_from_smoothness(4.0, 0.001) == pytest.approx(0.125)
    assert drsam.rho_max_from_smoothness(1e6, 0.001) == 0.001


def test_rho_from_smoothness_is_measured_in_warmup_and_used_after_it():
    hparams = {**drsam.DEFAULT_HPARAMS, "rho_from_smoothness": 1, "batch_size": 4, "smoothness_samples": 12}
    state: dict = {}
    warm = drsam.Client(hparams, {"round": 1, "warmup": True}, state)
    result = train_locally(tiny_model(), tiny_data(), warm, LocalSettings(epochs=1, batch_size=4), 0)
    L = result.metrics["smoothness"]
    assert L > 0 and state["smoothness"] == L
    later = drsam.Client(hparams, {"round": 5, "warmup": False}, state)
    later.begin(tiny_model(), [p.detach().clone() for p in tiny_model().parameters()], 4, 16)
    assert later.rho_max_k == pytest.approx(max(0.001, 1 / (2 * L)))
    off = drsam.Client(drsam.DEFAULT_HPARAMS, {"round": 5, "warmup": False}, state)
    off.begin(tiny_model(), [p.detach().clone() for p in tiny_model().parameters()], 4, 16)
    assert off.rho_max_k == 0.05  # the option is off by default: the fixed rho_max


def test_drsam_server_broadcasts_median_sigma_after_calibration_and_weights_by_lambda():
    server = drsam.Server({"lambda_weighting": 1})
    for round_no in range(1, 12):
        server.start_round(round_no, 3)
        assert server.broadcast()["warmup"] == (round_no <= 3)
        if round_no <= 10:
            assert server.broadcast()["median_sigma"] == 0.0
        for device, sigma in [("a", 0.1), ("b", 0.3), ("c", 0.5)]:
            server.observe(device, 10, {"sigma": sigma, "gamma": 0.9, "tau": 0.0})
    assert server.broadcast()["median_sigma"] == pytest.approx(0.3)
    assert server.weight(100, {"lambda": 0.2}) == pytest.approx(100 * math.exp(-0.2))


def test_drsam_state_survives_a_save_load_round_trip(tmp_path):
    disk = DeviceState(tmp_path)
    settings = LocalSettings(epochs=2, batch_size=4)
    for round_no in (4, 5):
        rule = drsam.Client(drsam.DEFAULT_HPARAMS, {"round": round_no, "warmup": False}, disk.section("drsam"))
        train_locally(tiny_model(), tiny_data(), rule, settings, round_no)
        disk.save()
        disk = DeviceState(tmp_path)  # as after a restart
    state = disk.section("drsam")
    assert state["participations"] == 2 and len(state["angles"]) == 1
    assert isinstance(state["g_fin"][0], np.ndarray) and state["g_fin"][0].shape == (3, 4)
    assert {"lambda", "rho", "gamma", "tau", "sigma_history"} <= set(state)


# --- baselines ---------------------------------------------------------------------------
def test_fedprox_adds_mu_times_drift():
    rule = fedprox.Client({"mu": 0.1}, {}, {})
    rule.begin(tiny_model(), t(1.0, 2.0), 1, 1)
    params = params_with_grad([3.0, 2.0], [0.5, 0.5])
    rule.adjust_gradients(0, params)
    assert torch.allclose(params[0].grad, torch.tensor([0.5 + 0.1 * 2.0, 0.5]))


def test_feddyn_client_and_server_follow_their_equations():
    state = {"h": [np.array([0.5, -1.0], dtype=np.float32)]}
    rule = feddyn.Client({"alpha": 0.1}, {}, state)
    rule.begin(tiny_model(), t(1.0, 2.0), 1, 1)
    params = params_with_grad([3.0, 2.0], [0.5, 0.5])
    rule.adjust_gradients(0, params)  # g + alpha (theta - theta_t + h)
    assert torch.allclose(params[0].grad, torch.tensor([0.5 + 0.1 * (2.0 + 0.5), 0.5 + 0.1 * (0.0 - 1.0)]))
    rule.end(params)  # h += theta_k - theta_t
    assert np.allclose(state["h"][0], [0.5 + 2.0, -1.0 + 0.0])

    server = feddyn.Server({})
    assert server.weight(500, {}) == 1.0  # the paper's uniform mean
    g = {"w": np.array([1.0, 1.0], dtype=np.float32)}
    server.start_round(1, population=4)
    server.observe("a", 1, {})
    server.observe("b", 1, {})
    new = server.new_global(g, {"w": np.array([0.4, -0.2], dtype=np.float32)})
    # H = (2/4) * mean delta = [0.2, -0.1]; theta = theta_t + mean delta + H
    assert np.allclose(new["w"], [1.0 + 0.4 + 0.2, 1.0 - 0.2 - 0.1])
    server.start_round(2, population=4)
    server.observe("c", 1, {})
    new2 = server.new_global(new, {"w": np.array([0.4, 0.0], dtype=np.float32)})
    assert np.allclose(new2["w"], new["w"] + [0.4, 0.0] + [0.2 + 0.1, -0.1])


def test_feddyn_server_in_buffered_mode_keeps_h_undamped_and_applies_it_paced_by_the_staleness():
    g = {"w": np.array([1.0, 1.0], dtype=np.float32)}
    server = feddyn.Server({})
    server.start_round(1, population=4)
    server.observe("a", 1, {})
    server.observe("b", 1, {})
    server.pace(damping=0.5, delay=1.0)  # the buffer's mean was damped by 0.5; its updates 1 version stale
    new = server.new_global(g, {"w": np.array([0.4, -0.2], dtype=np.float32)})
    # H adds the undamped mean, as the devices' duals do: (2/4) * [0.8, -0.4]; it enters as H / (1 + 1)^2
    assert np.allclose(server.H["w"], [0.4, -0.2])
    assert np.allclose(new["w"], [1.0 + 0.4 + 0.4 / 4, 1.0 - 0.2 - 0.2 / 4])
    server.start_round(2, population=4)  # a sync round after it: FedDyn's equations exactly
    server.observe("c", 1, {})
    new2 = server.new_global(new, {"w": np.array([0.4, 0.0], dtype=np.float32)})
    assert np.allclose(new2["w"], new["w"] + [0.4, 0.0] + [0.4 + 0.1, -0.2])


def test_leaky_dual_keeps_h_the_mean_of_the_device_duals_when_devices_miss_rounds():
    beta, m = 0.8, 3
    server = feddyn.Server({"dual_decay": beta})
    states: list[dict] = [{} for _ in range(m)]
    theta = {"weight": np.zeros((3, 4), np.float32), "bias": np.zeros(3, np.float32)}
    rng = np.random.default_rng(0)
    for round_no, present in enumerate([[0, 1], [2], [0], [1, 2], [0, 2]], start=1):
        server.start_round(round_no, population=m)
        broadcast = server.broadcast()
        deltas = []
        for k in present:
            rule = feddyn.Client({"dual_decay": beta}, broadcast, states[k])
            rule.begin(tiny_model(), [torch.tensor(theta["weight"]), torch.tensor(theta["bias"])], 1, 1)
            delta = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in theta.items()}
            rule.end([torch.tensor(theta[n] + delta[n]) for n in ("weight", "bias")])
            rule.committed(delta)
            server.observe(str(k), 1, {})
            deltas.append(delta)
        mean = {n: np.mean([d[n] for d in deltas], axis=0) for n in theta}
        theta = server.new_global(theta, mean)
        clock = server.broadcast()["dual_clock"]
        # every device's dual as it would load it now (the missed rounds' decay applied)
        duals = [[np.asarray(h) * beta ** (clock - st["h_clock"]) for h in st["h"]] if st else None for st in states]
        for i, name in enumerate(("weight", "bias")):
            mean_dual = sum(d[i] for d in duals if d is not None) / m
            assert np.allclose(server.H[name], mean_dual, atol=1e-6), (round_no, name)


def test_leaky_dual_off_is_feddyn_and_out_of_range_is_refused():
    assert feddyn.Server({}).broadcast() == {}  # beta = 1: no clock on the wire, FedDyn exactly
    server = feddyn.Server({"dual_decay": 0.9})
    server.start_round(1, population=2)
    server.observe("a", 1, {})
    server.new_global({"w": np.zeros(2, np.float32)}, {"w": np.ones(2, np.float32)})
    again = feddyn.Server({"dual_decay": 0.9})
    again.load_state(server.state())
    assert again.broadcast() == {"dual_clock": 1}
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="dual_decay must be in"):
            feddyn.Server({"dual_decay": bad})
    from broker_coordinator.settings.round_settings import RoundSettings
    with pytest.raises(ValueError, match=r"hparams: dual_decay must be in \(0, 1\]"):
        RoundSettings(algorithm="dynsam", hparams={"dual_decay": 1.5}).validate()  # at start-up, not in round 1


def test_fedsmoo_client_ascent_dual_and_server_perturbation():
    state = {"mu": [np.array([0.1, 0.0], dtype=np.float32)], "h": [np.zeros(2, dtype=np.float32)]}
    model = nn.Linear(2, 1, bias=False)
    tensors = {f"{fedsmoo.S}.weight": np.array([[0.0, 0.05]], dtype=np.float32).reshape(2)}
    rule = fedsmoo.Client({"rho": 0.05, "alpha": 0.1, "sam_every": 1}, {}, state, tensors)
    rule.begin(model, t(0.0, 0.0), 1, 1)
    params = params_with_grad([0.0, 0.0], [3.0, 4.0])
    eps = rule.perturbation(0, params, loss=1.0)
    d = torch.tensor([3.0 - 0.1 - 0.0, 4.0 - 0.0 - 0.05])  # g - mu - s
    assert torch.allclose(eps[0], 0.05 * d / d.norm())
    assert torch.allclose(rule.mu[0], torch.tensor([0.1, 0.0]) + eps[0] - torch.tensor([0.0, 0.05]))
    rule.end(params)
    assert set(rule.extra_tensors()) == {f"{fedsmoo.MU}.weight"}

    server = fedsmoo.Server({"rho": 0.05})
    server.start_round(1, population=2)
    server.observe("a", 1, {})
    g = {"w": np.zeros(2, dtype=np.float32)}
    mean_mu = np.array([3.0, 4.0], dtype=np.float32)
    new = server.new_global(g, {"w": np.array([1.0, 0.0], dtype=np.float32)}, {f"{fedsmoo.MU}.w": mean_mu})
    assert np.allclose(server.broadcast_tensors()[f"{fedsmoo.S}.w"], 0.05 * mean_mu / 5.0, atol=1e-6)
    assert np.allclose(new["w"], [1.0 + 0.5 * 1.0, 0.0])  # FedDyn's server rule, H = (1/2) mean delta


def test_dynsam_global_perturbation_option_uses_fedsmoos_dual_and_server():
    hparams = {**dynsam.DEFAULT_HPARAMS, "global_perturbation": 1, "sam_every": 1}
    state: dict = {}
    result = train_locally(tiny_model(), tiny_data(), dynsam.Client(hparams, {}, state), LocalSettings(batch_size=4), 0)
    assert {f"{fedsmoo.MU}.weight", f"{fedsmoo.MU}.bias"} <= set(result.delta) and "mu" in state
    server = dynsam.Server(hparams)
    specs = {"w": (2,)}
    assert server.extra_specs(specs) == {f"{fedsmoo.MU}.w": (2,)}
    server.start_round(1, 2)
    server.observe("d1", 10, {})
    server.new_global({"w": np.zeros(2, np.float32)}, {"w": np.zeros(2, np.float32)},
                      {f"{fedsmoo.MU}.w": np.array([3.0, 4.0], np.float32)})
    assert np.allclose(server.broadcast_tensors()[f"{fedsmoo.S}.w"], [0.03, 0.04], atol=1e-6)  # rho 0.05 * (3,4)/5
    assert dynsam.Server(dynsam.DEFAULT_HPARAMS).extra_specs(specs) == {}  # off by default: nothing extra sent


def test_balanced_softmax_adds_the_log_label_prior_to_the_logits():
    from edgefl_protocol.algorithms.losses import BalancedSoftmaxLoss

    labels = torch.tensor([0, 0, 0, 1])  # class 2 absent: smoothed count 1
    loss = BalancedSoftmaxLoss(labels)
    logits = torch.tensor([[0.5, -0.2, 0.1]])
    prior = torch.tensor([4.0, 2.0, 1.0]) / 7.0
    expected = nn.functional.cross_entropy(logits + prior.log(), torch.tensor([1]))
    assert torch.allclose(loss(logits, torch.tensor([1])), expected)
    rule = dynsam.Client({**dynsam.DEFAULT_HPARAMS, "balanced_loss": 1}, {}, {})
    assert isinstance(rule.loss_function(labels), BalancedSoftmaxLoss)
    assert isinstance(dynsam.Client(dynsam.DEFAULT_HPARAMS, {}, {}).loss_function(labels), nn.CrossEntropyLoss)


def test_fedsam_ascent_is_rho_along_the_gradient():
    rule = fedsam.Client({"rho": 0.05}, {}, {})
    rule.begin(tiny_model(), t(0.0, 0.0), 1, 1)
    eps = rule.perturbation(0, params_with_grad([0.0, 0.0], [3.0, 4.0]), loss=1.0)
    assert torch.allclose(eps[0], torch.tensor([0.03, 0.04]))


@pytest.mark.parametrize("name", ["fedsam", "fedsmoo", "drsam", "dynsam"])
def test_cpu_sized_mode_reuses_the_ascent(name):
    """sam_every=2 over 8 steps: 4 fresh steps (2 passes) + 4 reuse steps (1 pass) = 12 passes, full SAM 16."""
    algorithm = algorithms.get(name)
    broadcast = {"round": 5, "warmup": False}
    passes = {}
    for k in (1, 2):
        rule = algorithm.client({**algorithm.defaults, "sam_every": k, "m": 1}, broadcast, {})
        passes[k] = train_locally(tiny_model(), tiny_data(64), rule, LocalSettings(epochs=1, batch_size=8), 0).metrics["passes"]
    assert passes[1] == 16
    assert passes[2] == (13 if name == "drsam" else 12)  # DR-SAM refreshes in its last m steps too


def test_every_algorithm_trains_and_reports_its_signals():
    for name, algorithm in algorithms.ALGORITHMS.items():
        state: dict = {}
        rule = algorithm.client(algorithm.defaults, {"round": 5, "warmup": False}, state)
        result = train_locally(tiny_model(), tiny_data(), rule, LocalSettings(batch_size=4), 0)
        assert {"train_loss", "epochs", "steps", "train_seconds"} <= set(result.metrics), name
        assert all(np.isfinite(a).all() for a in result.delta.values()), name
    drsam_metrics = train_locally(tiny_model(), tiny_data(), new_rule := drsam.Client(
        drsam.DEFAULT_HPARAMS, {"round": 5}, {}), LocalSettings(batch_size=4), 0).metrics
    assert {"gamma", "sigma", "tau", "lambda_raw", "lambda", "rho"} <= set(drsam_metrics)
    assert new_rule.state["participations"] == 1


def test_dynsam_ratio_factor_is_clamped():
    assert dynsam.ratio_factor(0.2, 0.1, 2) == 2.0
    assert dynsam.ratio_factor(0.2, 0.8, 2) == 0.5
    assert dynsam.ratio_factor(0.2, 0.25, 2) == pytest.approx(0.8)
    assert dynsam.ratio_factor(0.2, None, 2) == 1.0 and dynsam.ratio_factor(0.0, 0.3, 2) == 1.0


@pytest.mark.parametrize("name", ["fedsam", "fedsmoo", "dynsam"])
def test_free_ascent_mode_costs_one_pass_per_step_after_the_first(name):
    algorithm = algorithms.get(name)
    rule = algorithm.client({**algorithm.defaults, "sam_every": 0}, {}, {})
    result = train_locally(tiny_model(), tiny_data(64), rule, LocalSettings(epochs=1, batch_size=8), 0)
    assert result.metrics["passes"] == 8 + 1
    assert all(np.isfinite(a).all() for a in result.delta.values())


def test_server_state_survives_a_checkpoint_round_trip():
    from edgefl_protocol.persist import pack, unpack

    server = fedsmoo.Server({})
    server.start_round(1, population=4)
    server.observe("a", 10, {})
    g = {"w": np.zeros(2, dtype=np.float32)}
    server.new_global(g, {"w": np.array([1.0, 2.0], dtype=np.float32)}, {f"{fedsmoo.MU}.w": np.ones(2, np.float32)})
    again = fedsmoo.Server({})
    again.load_state(unpack(pack(server.state())))
    assert np.allclose(again.H["w"], server.H["w"]) and np.allclose(again.s[f"{fedsmoo.S}.w"], server.s[f"{fedsmoo.S}.w"])
    d = drsam.Server({})
    d.start_round(5, 2)
    d.observe("a", 10, {"sigma": 0.2})
    d2 = drsam.Server({})
    d2.load_state(unpack(pack(d.state())))
    assert d2.sigma_sums == {"a": [0.2, 1]}


@pytest.mark.parametrize("clock", ["7", -1, 1.5, True])
def test_a_malformed_dual_clock_is_refused_before_the_dual_is_touched(clock):
    state = {"h": [np.ones((3, 4), np.float32), np.ones(3, np.float32)], "h_clock": 2}
    rule = feddyn.Client({"dual_decay": 0.9}, {"dual_clock": clock}, state)
    with pytest.raises(Rejected, match="dual_clock must be a whole number of rounds"):
        rule.begin(tiny_model(), [torch.zeros(3, 4), torch.zeros(3)], 1, 1)
    assert state["h_clock"] == 2 and np.all(state["h"][0] == 1)
