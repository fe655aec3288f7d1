"""edge_agent/device_step.py: the one step the agent and the in-memory benchmarks run (task in, signed
update out), and what differs between its callers passed in as parameters. Units: no broker."""

import zlib

import numpy as np

from bench.inmemory import InMemoryFederation, host_speed
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.fleet import PROFILES
from edge_agent.device_step import Budget, agent_seed, device_step
from edgefl_protocol import codec, messages, signing
from edgefl_models import datasets
from edgefl_models.architectures import build_model, set_weights

KEY = signing.new_key()


def _step(state: dict, hparams: dict, **kw):
    data = datasets.load("digits").train.subset(np.arange(60))
    task = messages.Task(3, 7, 0.0, "feddyn", hparams, {}, "float32", attempt=2)
    return device_step(task, build_model("digits_mlp", 0), data, state, device="dev-a", federation="f", key=KEY,
                       seed=agent_seed("dev-a", 3), **{"budget": Budget(lambda: 1e4, 5.0), **kw})


def test_the_step_signs_what_it_trained_and_commits_nothing_the_server_mirrors():
    state = {"codec": {"owed": ["1.1"]}}
    step = _step(state, {"local_epochs": 1}, report={"model_sha": "ab"}, down={"bytes_down": 12},
                 budget=Budget(lambda: 1 / 0, 5.0))  # epochs fixed by the task: the speed is never asked
    update = messages.decode_answer(step.payload, 1 << 26, KEY, "dev-a")
    assert (update.round, update.attempt, update.model_version, update.federation) == (3, 2, 7, "f")
    assert update.metrics["epochs_reason"] == "fixed by the coordinator" and update.metrics["model_sha"] == "ab"
    assert update.metrics["bytes_down"] == 12 and update.metrics["owed"] == "1.1"
    assert step.sent.down == {"bytes_down": 12} and step.sent.claims == ["1.1"] and step.sent.key == (3, 2)
    assert step.sent.before == {} and step.sent.algorithm == "feddyn"  # settlement commits or restores it


def test_the_epochs_are_planned_from_the_budget_when_the_task_leaves_them_to_the_device():
    asked = []
    step = _step({}, {"local_epochs": 0}, budget=Budget(lambda: asked.append(1) or 1e4, 5.0))
    assert asked == [1] and step.epochs >= 1 and step.epochs_reason != "fixed by the coordinator"


def test_the_seconds_a_calibration_takes_come_out_of_the_round_s_budget():
    """A device's first round calibrates its speed inside the deadline: the epochs fit what is left."""
    ticks = iter([0.0, 3.0])  # the speed takes 3 of the budget's 5 seconds
    # 60 samples at 100 samples/s: 0.6 s an epoch; 2 s left x 0.7 fits 2 epochs (5 s would fit 5)
    step = _step({}, {"local_epochs": 0}, budget=Budget(lambda: 100.0, 5.0, clock=lambda: next(ticks)))
    assert step.epochs == 2 and "capped to fit 2 s" in step.epochs_reason


def test_a_tamper_changes_what_is_sent_and_what_is_settled():
    def reverse(delta, n):
        return {k: -10 * v for k, v in delta.items()}, 10 * n

    honest, forged = _step({}, {"local_epochs": 1}), _step({}, {"local_epochs": 1}, tamper=reverse)
    update = messages.decode_answer(forged.payload, 1 << 26, KEY, "dev-a")
    sent = codec.decode(update.codec, update.specs, update.body, None, 1 << 26)
    assert update.num_samples == 600
    for name, value in honest.sent.delta.items():  # sent as tampered, and settled as sent (its residual, owed)
        np.testing.assert_allclose(sent[name], -10 * value, rtol=1e-6)
        np.testing.assert_array_equal(forged.sent.delta[name], sent[name])


def test_the_in_memory_driver_runs_the_agents_step():
    """With the agent's seed and the same codec rounding, the driver's update is the step's, byte for byte
    (but for the seconds it took)."""
    data = datasets.load("digits")
    shards = [data.train.subset(np.arange(i * 50, (i + 1) * 50)) for i in range(2)]
    settings = RoundSettings(algorithm="fedavg", codec="q4c64+zlib", local_epochs=0, batch_size=16)
    fed = InMemoryFederation("digits_mlp", shards, data.test, settings, seed=1, clients_per_round=2,
                             mirror_agent_seed=True)
    hp = settings.task_hparams(1)
    driven = fed.train("dev-000", 1, hp)
    model = build_model("digits_mlp")
    set_weights(model, fed.coordinator.weights)
    direct = device_step(fed.task(1, hp), model, shards[0], {}, device="dev-000", federation="bench",
                         key=fed.keys["dev-000"], seed=agent_seed("dev-000", 1),
                         budget=Budget(lambda: host_speed("digits_mlp") * PROFILES["pi4"].speed,
                                       settings.round_timeout),
                         released=fed.coordinator.server_rule.broadcast_tensors(),
                         rounding=np.random.default_rng(zlib.crc32(b"codec/dev-000/1")))
    a, b = (messages.decode_answer(x.payload, 1 << 26, fed.keys["dev-000"], "dev-000") for x in (driven, direct))
    assert a.body == b.body and a.num_samples == b.num_samples and driven.epochs == direct.epochs > 0
    assert {k: v for k, v in a.metrics.items() if k != "train_seconds"} == {
        k: v for k, v in b.metrics.items() if k != "train_seconds"}
