"""Server optimizers (broker_coordinator/aggregation/server_optimizer.py): each against a hand
computation of Reddi et al.'s update equations, applied by the engine after the algorithm's server
rule in every schedule and topology, its moments checkpointed and restored."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from broker_coordinator.aggregation.server_optimizer import ServerOptimizer
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.engine.rounds import RoundState
from broker_coordinator.engine.site_aggregator import SiteWorker
from broker_coordinator.engine.tree import SiteSpec
from broker_coordinator.simulation.in_memory import fold_partials, fold_round
from broker_coordinator.storage.store import Store
from edgefl_protocol import codec, messages, signing
from edgefl_protocol.settings import ConfigError, build_section
from edgefl_protocol.site_partials import SiteTask, encode_partial
from edgefl_models import datasets

FED, ARCH = "test", "digits_mlp"
SIMPLE = dict(algorithm="fedavg", codec="float32", aggregator="mean", norm_bound=0, weighting="reported", round_timeout=60)


def _steps(name, deltas, **kw):
    """Apply `deltas` (the server rule's steps, one scalar each) from x = 0; the models after each."""
    opt = ServerOptimizer(name, **kw)
    x, out = {"w": np.zeros(1, np.float32)}, []
    for d in deltas:
        x = opt.apply(x, {"w": x["w"] + np.float32(d)})
        out.append(float(x["w"][0]))
    return out


def test_sgd_at_rate_one_is_the_server_rule_alone_bit_for_bit():
    opt = ServerOptimizer("sgd", lr=1.0)
    proposed = {"w": np.array([0.1, -2.5], np.float32)}
    assert opt.apply({"w": np.zeros(2, np.float32)}, proposed)["w"] is proposed["w"]
    assert RoundSettings().server_optimizer == "sgd" and RoundSettings().server_step_size() == 1.0
    assert _steps("sgd", [1.0, 2.0], lr=0.5) == pytest.approx([0.5, 1.5])


def test_momentum_is_heavy_ball_on_the_pseudo_gradient():
    # m1 = 1; x1 = 0.5 * 1. m2 = 0.9 * 1 + 2 = 2.9; x2 = 0.5 + 0.5 * 2.9
    assert _steps("momentum", [1.0, 2.0], lr=0.5, momentum=0.9) == pytest.approx([0.5, 0.5 + 1.45])
    # unset server_lr: 1 - server_momentum, the same long-run step as sgd on a steady pseudo-gradient
    assert RoundSettings(server_optimizer="momentum", server_momentum=0.8).server_step_size() == pytest.approx(0.2)


def test_server_lr_decay_shrinks_each_step_geometrically_and_resumes_from_the_checkpoint():
    # steps 1, 0.5, 0.25 of a constant pseudo-gradient 1
    assert _steps("sgd", [1.0, 1.0, 1.0], lr=1.0, lr_decay=0.5) == pytest.approx([1.0, 1.5, 1.75])
    # momentum: m = 1, 1.9, 2.71 at rates 0.5, 0.25, 0.125
    assert _steps("momentum", [1.0, 1.0, 1.0], lr=0.5, momentum=0.9, lr_decay=0.5) == pytest.approx(
        [0.5, 0.5 + 0.475, 0.5 + 0.475 + 0.33875])
    assert not ServerOptimizer("sgd", lr=1.0, lr_decay=0.9).is_identity
    assert RoundSettings(server_lr_decay=0.9).server_lr_decay == 0.9 and RoundSettings().server_lr_decay == 1.0
    # a restarted coordinator continues the schedule where the checkpoint left it
    opt = ServerOptimizer("momentum", lr=1.0, lr_decay=0.8)
    x = {"w": np.zeros(1, np.float32)}
    for _ in range(3):
        x = opt.apply(x, {"w": x["w"] + np.float32(1.0)})
    resumed = ServerOptimizer("momentum", lr=1.0, lr_decay=0.8)
    resumed.load_state(opt.state(), {"w": (1,)})
    assert resumed.step_size() == pytest.approx(0.8 ** 3) == opt.step_size()
    assert "server_lr_decay 0.8" in resumed.describe()


@pytest.mark.parametrize("name", ["adam", "yogi", "adagrad"])
def test_adaptive_optimizers_follow_reddi_et_al_algorithm_2(name):
    b1, b2, tau, lr = 0.9, 0.99, 1e-3, 0.1
    d1, d2 = 1.0, -0.5
    v0 = tau ** 2
    m1 = (1 - b1) * d1
    v1 = {"adam": b2 * v0 + (1 - b2) * d1 ** 2, "adagrad": v0 + d1 ** 2,
          "yogi": v0 - (1 - b2) * d1 ** 2 * math.copysign(1, v0 - d1 ** 2)}[name]
    x1 = lr * m1 / (math.sqrt(v1) + tau)
    m2 = b1 * m1 + (1 - b1) * d2
    v2 = {"adam": b2 * v1 + (1 - b2) * d2 ** 2, "adagrad": v1 + d2 ** 2,
          "yogi": v1 - (1 - b2) * d2 ** 2 * math.copysign(1, v1 - d2 ** 2)}[name]
    x2 = x1 + lr * m2 / (math.sqrt(v2) + tau)
    assert _steps(name, [d1, d2], lr=lr, beta1=b1, beta2=b2, tau=tau) == pytest.approx([x1, x2], rel=1e-5)


def test_defaults_are_reddi_et_al_and_documented_rates():
    s = RoundSettings(server_optimizer="adam")
    assert (s.beta1, s.beta2, s.tau, s.server_momentum) == (0.9, 0.99, 1e-3, 0.9)
    assert s.server_step_size() == 0.01 and RoundSettings(server_optimizer="adagrad").server_step_size() == 0.1
    assert RoundSettings(server_optimizer="yogi", server_lr=0.3).server_step_size() == 0.3


@pytest.mark.parametrize("key,value,says", [
    ("server_optimizer", "lamb", "server_optimizer must be one of sgd, momentum, adam, yogi, adagrad"),
    ("server_lr", 0.0, "server_lr must be in (0, 10]"),
    ("server_lr", -1, "server_lr must be in (0, 10]"),
    ("server_momentum", 1.0, "server_momentum must be in [0, 1)"),
    ("server_lr_decay", 0.0, "server_lr_decay must be in (0, 1]"),
    ("server_lr_decay", 1.5, "server_lr_decay must be in (0, 1]"),
    ("beta1", -0.1, "beta1 must be in [0, 1)"),
    ("beta2", 1.5, "beta2 must be in [0, 1)"),
    ("tau", 0, "tau must be > 0"),
])
def test_bad_values_are_refused_naming_the_key(key, value, says):
    with pytest.raises(ConfigError, match=r"coordinator.toml \[rounds\]: " + re_escape(says)):
        build_section(RoundSettings, {key: value}, "coordinator.toml [rounds]")


def re_escape(text: str) -> str:
    import re
    return re.escape(text)


# --- in the engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


def _payloads(c: Engine, values: dict[str, float], round_no: int, keys: dict[str, bytes]) -> dict[str, bytes]:
    """Each device's delta: every coordinate `value` (float32, 10 samples each)."""
    task = messages.Task(round_no, c.version, time.time() + 60, c.settings.algorithm,
                         c.settings.task_hparams(round_no), {}, "float32", 1)
    out = {}
    for device, value in values.items():
        encoded = codec.encode({n: np.full(s, value, np.float32) for n, s in c.specs.items()}, "float32")
        update = messages.Update(device, round_no, task.model_version, 10, {"steps": 1}, encoded.body,
                                 encoded.codec, encoded.specs, FED, 1)
        out[device] = messages.encode_update(update, keys[device])
    return out


KEYS = {d: signing.new_key() for d in ("a", "b", "c")}


def test_the_engine_applies_it_after_the_server_rule_each_round(digits):
    c = Engine(FED, ARCH, digits.test, RoundSettings(server_optimizer="momentum", server_lr=0.5, **SIMPLE),
                    device_keys=KEYS)
    x0 = {n: a.copy() for n, a in c.weights.items()}
    fold_round(c, _payloads(c, {"a": 0.01, "b": 0.03}, 1, KEYS), 1)  # mean step 0.02: m = 0.02
    fold_round(c, _payloads(c, {"a": 0.01, "c": 0.01}, 2, KEYS), 2)  # step 0.01: m = 0.9 * 0.02 + 0.01
    for n in x0:
        np.testing.assert_allclose(c.weights[n], x0[n] + 0.5 * 0.02 + 0.5 * 0.028, atol=1e-6)
    assert c.server_optimizer.steps == 2


def test_checkpoint_resume_keeps_the_moments(tmp_path, digits):
    settings = RoundSettings(server_optimizer="adam", server_lr=0.05, **SIMPLE)
    through = Engine(FED, ARCH, digits.test, settings, device_keys=KEYS)
    first = Engine(FED, ARCH, digits.test, settings, device_keys=KEYS, store=Store(tmp_path))
    for c in (through, first):
        fold_round(c, _payloads(c, {"a": 0.02, "b": -0.01}, 1, KEYS), 1)
    first.close()
    resumed = Engine(FED, ARCH, digits.test, settings, device_keys=KEYS, store=Store(tmp_path))
    assert resumed.server_optimizer.steps == 1
    for key in ("m", "v"):
        mine, theirs = getattr(resumed.server_optimizer, key), getattr(through.server_optimizer, key)
        assert set(mine) == set(theirs) and all(np.array_equal(mine[n], theirs[n]) for n in mine)
    for c in (through, resumed):
        fold_round(c, _payloads(c, {"a": 0.03, "c": 0.01}, 2, KEYS), 2)
    for n in through.weights:
        np.testing.assert_array_equal(resumed.weights[n], through.weights[n])
    resumed.close()


def test_a_checkpoint_of_another_optimizer_starts_fresh_and_says_so(tmp_path, digits, caplog):
    c = Engine(FED, ARCH, digits.test, RoundSettings(server_optimizer="yogi", **SIMPLE), device_keys=KEYS,
                    store=Store(tmp_path))
    fold_round(c, _payloads(c, {"a": 0.02}, 1, KEYS), 1)
    c.close()
    with caplog.at_level("WARNING"):
        other = Engine(FED, ARCH, digits.test, RoundSettings(server_optimizer="adam", **SIMPLE),
                            device_keys=KEYS, store=Store(tmp_path))
    assert "server optimizer was yogi; adam (server_lr 0.01, beta1 0.9, beta2 0.99, tau 0.001) starts with zero " \
           "moments" in caplog.text
    assert other.server_optimizer.m == {} and other.next_round == 2
    other.close()


def test_an_evaluation_only_round_takes_no_step(digits):
    c = Engine(FED, ARCH, digits.test, RoundSettings(server_optimizer="momentum", eval_only_every=2, **SIMPLE),
                    device_keys=KEYS)
    fold_round(c, _payloads(c, {"a": 0.02}, 1, KEYS), 1)
    assert c.server_optimizer.steps == 1


def test_the_delta_downlink_releases_the_optimizers_model(digits):
    c = Engine(FED, ARCH, digits.test, RoundSettings(server_optimizer="adam", downlink="delta", **SIMPLE),
                    device_keys=KEYS)
    before = {n: a.copy() for n, a in c.weights.items()}
    fold_round(c, _payloads(c, {"a": 0.02, "b": 0.04}, 1, KEYS), 1)
    assert c.broadcast is not None and c.broadcast.version == c.version == 1

    def distance(a, b):
        return math.sqrt(sum(float(np.sum((a[n] - b[n]) ** 2)) for n in c.weights))
    # B moves towards G, the optimizer's model, by what the lossy (sparse) downlink delta carries; G - B is owed
    assert distance(c.broadcast.tensors, c.weights) < 0.97 * distance(before, c.weights)
    moved = sum(float(np.sum((c.broadcast.tensors[n] - before[n]) * (c.weights[n] - before[n]))) for n in c.weights)
    assert moved > 0


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_buffered_applies_it_once_per_version(tmp_path, digits, decay):
    from broker_coordinator.engine.buffered import Ticket
    from broker_coordinator.storage.store import model_sha256
    settings = RoundSettings(mode="buffered", buffer_size=2, server_optimizer="momentum",
                             server_lr=0.5, server_lr_decay=decay, **SIMPLE)
    c = Engine(FED, ARCH, digits.test, settings, store=Store(tmp_path), device_keys=KEYS)
    x0 = {n: a.copy() for n, a in c.weights.items()}
    expected_m = 0.0
    for version, values in enumerate([{"a": 0.02, "b": 0.02}, {"a": 0.01, "c": 0.01}], start=1):
        buffer = c.schedule.open_buffer(c, version)
        for attempt, (device, payload) in enumerate(_payloads(c, values, version, KEYS).items(), start=1):
            c.schedule.tickets[(version, attempt)] = Ticket(device, c.version, time.time() + 60)
            c.schedule.working[device] = (version, attempt)
            c.intake.on_update(buffer, device, _reattempt(payload, device, attempt), time.time())
        assert buffer.aggregate.count == 2
        c.set_state(buffer, RoundState.CLOSED)  # what run_round does with a full buffer
        c.conclude(buffer, model_sha256(c.weights))
        expected_m = 0.9 * expected_m + sum(values.values()) / 2
        assert c.server_optimizer.steps == version
    for n in x0:
        # version 2's step is taken at 0.5 * decay (the decay counts applied versions)
        np.testing.assert_allclose(c.weights[n], x0[n] + 0.5 * 0.02 + 0.5 * decay * expected_m, atol=1e-6)
    c.close()


def _reattempt(payload: bytes, device: str, attempt: int) -> bytes:
    """The same update as the answer to task `attempt` (buffered tasks number their attempts)."""
    update = messages.decode_update(payload, 1 << 24, KEYS[device])
    update.attempt = attempt
    return messages.encode_update(update, KEYS[device])


@pytest.mark.parametrize("server", [dict(server_optimizer="yogi", server_lr=0.05),
                                    dict(server_optimizer="momentum", server_lr=0.5, server_lr_decay=0.5)],
                         ids=["yogi", "momentum-decaying"])
def test_sites_apply_it_as_the_flat_coordinator_does(digits, server):
    settings = RoundSettings(**server, **SIMPLE)
    keys = {f"{s}-{i}": signing.new_key() for s in ("north", "south") for i in range(2)}
    site_keys = {s: signing.new_key() for s in ("north", "south")}
    flat = Engine(FED, ARCH, digits.test, settings, device_keys=keys)
    tree = Engine(FED, ARCH, digits.test, settings, device_keys={},
                           sites={s: SiteSpec(1, k) for s, k in site_keys.items()})
    for round_no in (1, 2):
        payloads = _payloads(flat, {d: 0.01 * (i + round_no) for i, d in enumerate(keys)}, round_no, keys)
        fold_round(flat, payloads, round_no)
        task = messages.Task(round_no, tree.version, time.time() + 60, "fedavg", settings.task_hparams(round_no),
                             {}, "float32", 1)
        site_task = SiteTask(round_no, 1, 0, messages.encode("task", task),
                             {"weighting": "reported", "norm_bound": 0.0, "aggregator": "mean"})
        partials = []
        for site, key in site_keys.items():
            worker = SiteWorker(FED, site, ARCH, key, keys)
            mine = {d for d in keys if d.startswith(site)}
            rnd = worker.open(site_task, task, mine)
            for device in sorted(mine):
                worker.intake.on_update(rnd, device, payloads[device], time.time())
            partials.append((site, encode_partial(worker.partial(rnd), key)))
        fold_partials(tree, {"north": 2, "south": 2}, partials, round_no)
    assert tree.server_optimizer.steps == flat.server_optimizer.steps == 2
    for n in flat.weights:
        np.testing.assert_allclose(tree.weights[n], flat.weights[n], rtol=1e-5, atol=1e-6)
        assert not np.allclose(flat.weights[n], Engine(FED, ARCH, digits.test, settings).weights[n])


# --- with a server rule that carries its own state (FedDyn's H) -----------------------------

def test_the_optimizer_steps_on_the_mean_delta_and_adds_feddyns_h_outside_its_moments(digits):
    """FedDyn's server rule steps by mean delta + H. The optimizer's pseudo-gradient is the mean delta;
    H, itself a running sum of past mean deltas, is added as the rule made it (never momented)."""
    kind = dict(SIMPLE, algorithm="feddyn")
    plain = Engine(FED, ARCH, digits.test, RoundSettings(**kind), device_keys=KEYS)
    heavy = Engine(FED, ARCH, digits.test, RoundSettings(server_optimizer="momentum", server_lr=0.5, **kind),
                        device_keys=KEYS)
    x0 = {n: a.copy() for n, a in plain.weights.items()}
    answers = [{"a": 0.01, "b": 0.03}, {"a": 0.02, "c": 0.0}]
    steps = []
    for round_no, values in enumerate(answers, start=1):
        before = {n: a.copy() for n, a in plain.weights.items()}
        for c in (plain, heavy):
            fold_round(c, _payloads(c, values, round_no, KEYS), round_no)
        steps.append({n: plain.weights[n].astype(np.float64) - before[n] for n in x0})
    name = next(iter(x0))
    # every device of the round answered (share 1): H_1 = 0.02, so FedDyn's first step is 0.02 + 0.02
    np.testing.assert_allclose(steps[0][name], 0.04, atol=1e-6)
    np.testing.assert_allclose(steps[1][name], 0.01 + 0.03, atol=1e-6)  # mean 0.01 + H_2 = 0.03
    # heavy ball on the mean deltas (m_1 = 0.02, m_2 = 0.9 * 0.02 + 0.01) at rate 0.5, plus H_1 and H_2
    expected = 0.5 * 0.02 + 0.02 + 0.5 * (0.9 * 0.02 + 0.01) + 0.03
    for n in x0:
        np.testing.assert_allclose(heavy.weights[n], x0[n] + expected, atol=1e-5)
    assert heavy.server_rule.H is not None and plain.server_rule.H is not None
    for n in x0:  # the dual itself is the server rule's, untouched by the optimizer
        np.testing.assert_array_equal(heavy.server_rule.H[n], plain.server_rule.H[n])


def test_without_a_rule_of_its_own_the_split_changes_nothing():
    # fedavg's step is the mean delta: passing it gives the same model as taking x' - x
    x = {"w": np.array([0.5, -1.0], np.float32)}
    mean = {"w": np.array([0.25, 0.125], np.float32)}
    proposed = {"w": x["w"] + mean["w"]}
    split, whole = ServerOptimizer("momentum", lr=0.3), ServerOptimizer("momentum", lr=0.3)
    for _ in range(3):
        a, b = split.apply(x, proposed, mean), whole.apply(x, proposed)
        np.testing.assert_allclose(a["w"], b["w"], rtol=1e-6)


def test_feddyn_with_server_momentum_runs_and_converges_on_a_small_problem():
    from bench.inmemory import InMemoryFederation
    from edgefl_models import partition
    data = datasets.load("digits")
    clients = [data.train.subset(p) for p in partition.split("dirichlet:0.3", data.train.y, 10, 0)]
    # the plain mean: this checks the server optimizer's path; on 10 devices of Dirichlet(0.3) digits the
    # default fold's agreement stage flags honest updates too, and with server momentum that cost
    # 7 points at round 20 (83.1% against 90.0%), a known interaction of the two
    settings = RoundSettings(algorithm="feddyn", local_epochs=1, codec="float32", server_optimizer="momentum",
                             server_momentum=0.5, aggregator="mean")
    fed = InMemoryFederation("digits_mlp", clients, data.test, settings, seed=1, clients_per_round=10)
    records = [fed.round(r) for r in range(1, 21)]
    accuracy = [r.accuracy for r in records]
    assert accuracy[-1] >= 0.85, accuracy
    assert fed.coordinator.server_optimizer.steps == 20 and all(math.isfinite(r.loss) for r in records)
