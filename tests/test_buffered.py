"""Buffered asynchronous mode: the staleness rule, the drop of too-stale updates, the dual algorithms
served with the buffer's pace, and (end to end, real Mosquitto and agent processes) versions applied from stale-but-allowed
updates while too-stale ones are dropped with a reason."""

import json
import math
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

from broker_coordinator.engine.buffered import Ticket
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.engine.rounds import RoundState
from broker_coordinator.aggregation.staleness import staleness_factor
from broker_coordinator.settings import composition
from broker_coordinator.storage.store import Store
from edgefl_protocol import messages
from edgefl_protocol.settings import ConfigError, build_section
from edgefl_models import datasets

KEY = b"unit-test-key-0123456789abcdef01"
DEVICES = ("d1", "d2", "d3")


def test_staleness_factor_is_fedbuffs_inverse_square_root():
    assert staleness_factor("inverse_sqrt", 0) == 1.0
    assert math.isclose(staleness_factor("inverse_sqrt", 3), 0.5)
    assert staleness_factor("constant", 7) == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_factor("inverse_sqrt", -1)


@pytest.mark.parametrize("algorithm,hparams", [("fedavg", {}), ("fedprox", {}), ("fedsam", {}), ("drsam", {}),
                                               ("dynsam", {"dual": 0})])
def test_buffered_serves_algorithms_without_round_bound_server_state(algorithm, hparams):
    RoundSettings(algorithm=algorithm, hparams=hparams, mode="buffered").validate()


@pytest.mark.parametrize("algorithm", ["dynsam", "feddyn", "fedsmoo"])
def test_buffered_serves_the_dual_algorithms_flat_and_in_sites(algorithm):
    settings = build_section(RoundSettings, {"mode": "buffered", "algorithm": algorithm}, "c.toml [rounds]")
    assert composition.refusals(settings, "flat") == [] and composition.refusals(settings, "sites") == []


def test_a_buffers_damping_and_staleness_reach_the_server_rule(tmp_path):
    c, buffer = _coordinator(tmp_path)
    c.version = 3
    for attempt, (device, version) in enumerate([("d1", 3), ("d2", 2), ("d3", 0)], start=1):
        _task(c, device, version, attempt)
    c.intake.on_update(buffer, "d1", _answer(c, "d1", 3, 1, 0.1, num_samples=30), time.time())  # fresh
    c.intake.on_update(buffer, "d2", _answer(c, "d2", 2, 2, 0.4, num_samples=10), time.time())  # 1 version old
    c.intake.on_update(buffer, "d3", _answer(c, "d3", 0, 3, 0.2, num_samples=10), time.time())  # too stale: dropped
    assert buffer.aggregate.report().delay == pytest.approx(10 / 40)  # weighted by n_k: (30 * 0 + 10 * 1) / 40
    seen = []
    c.server_rule.pace = lambda damping, delay: seen.append((damping, delay))
    buffer.move(RoundState.CLOSED)
    c.conclude(buffer, "")
    assert seen == [(pytest.approx((30 + 10 / math.sqrt(2)) / 40), pytest.approx(0.25))]


@pytest.mark.parametrize("key,value,says", [("buffer_size", 0, "buffer_size must be >= 1"),
                                            ("max_staleness", -1, "max_staleness must be >= 0"),
                                            ("staleness_weight", "linear", "staleness_weight must be one of"),
                                            ("mode", "async", "mode must be one of sync, buffered"),
                                            ("eval_only_every", 3, "mode buffered \\+ eval_only_every .* "
                                                                   "set eval_only_every = 0")])
def test_buffered_settings_are_validated_naming_the_key(key, value, says):
    with pytest.raises(ConfigError, match=says):
        build_section(RoundSettings, {"mode": "buffered", "algorithm": "fedavg", key: value}, "c.toml [rounds]")


def _evaluated(c, device, version, attempt, score):
    tensors = {k: np.zeros_like(v) for k, v in c.weights.items()}
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    metrics = {"steps": 1, "eval_metric": "accuracy", "eval_score": score, "eval_loss": 1.0, "eval_count": 20}
    return messages.encode_update(messages.Update(device, 1, version, 10, metrics, body, "float32", specs, "u",
                                                  attempt), KEY)


def test_without_a_test_set_buffered_versions_are_scored_by_the_devices_that_measured_them(tmp_path):
    """A buffer's federated score is the reports of the newest version its devices measured."""
    s = RoundSettings(algorithm="fedavg", codec="float32", mode="buffered", aggregator="mean", max_staleness=2)
    c = Engine("u", "digits_mlp", None, s, store=Store(tmp_path), device_keys={d: KEY for d in DEVICES})
    assert c.evaluate_devices and not c.evaluate_central
    c.version = 4
    buffer = c.schedule.open_buffer(c, 1)
    for attempt, (device, version) in enumerate([("d1", 4), ("d2", 3), ("d3", 4)], start=1):
        _task(c, device, version, attempt)
    c.intake.on_update(buffer, "d1", _evaluated(c, "d1", 4, 1, 0.8), time.time())
    c.intake.on_update(buffer, "d2", _evaluated(c, "d2", 3, 2, 0.1), time.time())  # measured version 3, not 4
    c.intake.on_update(buffer, "d3", _evaluated(c, "d3", 4, 3, 0.6), time.time())
    assert buffer.aggregate.count == 3 and buffer.evaluated == {"d1": 4, "d2": 3, "d3": 4}
    record = c.record(buffer, "", "", "complete")
    assert record.federated["score"] == pytest.approx(0.7) and record.federated["model_version"] == 4


def _coordinator(tmp_path, **settings):
    s = RoundSettings(algorithm="fedavg", codec="float32", mode="buffered", aggregator="mean", norm_bound=0,
                      weighting="reported", max_staleness=2, **settings)
    c = Engine("u", "digits_mlp", datasets.load("digits").test, s, store=Store(tmp_path),
                            device_keys={d: KEY for d in DEVICES})
    return c, c.schedule.open_buffer(c, 1)


def _task(c, device, version, attempt, deadline=None):
    """What `_dispatch` records for a task sent to `device` to train from `version`."""
    c.schedule.tickets[(1, attempt)] = Ticket(device, version, deadline or time.time() + 60)
    c.schedule.working[device] = (1, attempt)


def _answer(c, device, version, attempt, value, num_samples=10):
    tensors = {k: np.full_like(v, value) for k, v in c.weights.items()}
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    return messages.encode_update(messages.Update(device, 1, version, num_samples, {"steps": 1}, body, "float32",
                                                  specs, "u", attempt), KEY)


def test_stale_updates_count_less_and_too_stale_ones_are_dropped(tmp_path, caplog):
    c, buffer = _coordinator(tmp_path)
    c.version = 3  # the server moved on while the tasks were out
    for attempt, (device, version) in enumerate([("d1", 3), ("d2", 2), ("d3", 0)], start=1):
        _task(c, device, version, attempt)
    with caplog.at_level("INFO"):
        c.intake.on_update(buffer, "d1", _answer(c, "d1", 3, 1, 0.1, num_samples=30), time.time())  # fresh
        c.intake.on_update(buffer, "d2", _answer(c, "d2", 2, 2, 0.4, num_samples=10), time.time())  # 1 version old
        c.intake.on_update(buffer, "d3", _answer(c, "d3", 0, 3, 9.0), time.time())  # 3 versions old: S is 2
    assert buffer.aggregate.count == 2 and c.intake.rejections == {"too_stale": 1} and buffer.rejected["too_stale"] == 1
    assert "d3 rejected: too_stale: update was trained on model version 0; the server is at version 3" in caplog.text
    assert buffer.device_metrics["d2"]["staleness"] == 1 and buffer.device_metrics["d2"]["weight"] == pytest.approx(
        10 / math.sqrt(2))
    assert c.schedule.working == {} and c.schedule.tickets == {}  # every answered device may get a new task
    # FedBuff's step: sum n_k f(s_k) delta_k / sum n_k
    expected = (30 * 0.1 + 10 / math.sqrt(2) * 0.4) / 40
    step = buffer.aggregate.result()
    assert all(np.allclose(a, expected, atol=1e-6) for a in step.values())
    assert buffer.aggregate.report().damping == pytest.approx((30 + 10 / math.sqrt(2)) / 40)


def test_answers_to_no_open_task_are_rejected_with_their_reason(tmp_path):
    c, buffer = _coordinator(tmp_path)
    c.intake.on_update(buffer, "d1", _answer(c, "d1", 0, 5, 0.1), time.time())  # no such task
    _task(c, "d1", 0, 1)
    c.intake.on_update(buffer, "d2", _answer(c, "d2", 0, 1, 0.1), time.time())  # d1's task
    _task(c, "d3", 0, 2, deadline=time.time() - 1)
    c.intake.on_update(buffer, "d3", _answer(c, "d3", 0, 2, 0.1), time.time())  # past its deadline
    assert c.intake.rejections == {"stale": 1, "not_selected": 1, "late": 1} and buffer.aggregate.count == 0
    assert "d1" in c.schedule.working and "d3" not in c.schedule.working  # d1 still holds its task


def test_a_resend_is_answered_while_buffered_and_after_the_version_is_applied(tmp_path):
    c, buffer = _coordinator(tmp_path)
    _task(c, "d1", 0, 1)
    update = _answer(c, "d1", 0, 1, 0.1)
    c.intake.on_update(buffer, "d1", update, time.time())
    c.intake.on_update(buffer, "d1", update, time.time())  # its receipt was lost: answered again, not folded twice
    assert buffer.aggregate.count == 1 and not c.intake.rejections
    c.set_state(buffer, RoundState.CLOSED)
    c.conclude(buffer, "")
    c.schedule.in_buffer = set()
    later = c.schedule.open_buffer(c, 2)
    c.intake.on_update(later, "d1", update, time.time())  # the same bytes: answered with their verdict, not folded
    assert not c.intake.rejections and later.aggregate.count == 0 and c.version == 1
    assert c.verdicts.of(("d1", 1, 1)).kind == "folded"  # folded into the version being built
    c.intake.on_update(later, "d1", _answer(c, "d1", 0, 1, 0.2), time.time())  # other bytes for the same task
    assert c.intake.rejections == {"replay": 1} and later.aggregate.count == 0


class FakeSession:
    """Records what the coordinator publishes; the broker acknowledges everything."""

    def __init__(self):
        self.cleared, self.tasks = [], []

    def publish(self, topic, payload, qos=1, retain=False):
        if retain and not payload:
            self.cleared.append(topic)

    def publish_until(self, topic, payload, deadline, retain=False):
        return True

    def publish_all(self, messages_, deadline, qos=1):
        self.tasks += [(topic.split("/")[3], messages.decode_task(payload)) for topic, payload in messages_]
        return []


def test_idle_devices_get_one_task_at_a_time_naming_the_current_version(tmp_path):
    c, buffer = _coordinator(tmp_path, clients_per_round=2)
    c.transport, c.presence_settled = FakeSession(), True
    c.presence.online = {d: {} for d in DEVICES}
    c.topology.dispatch(c, c.schedule, buffer)
    c.topology.dispatch(c, c.schedule, buffer)  # nobody is free: no second task, and at most 2 out (clients_per_round)
    assert len(c.transport.tasks) == 2 and len(c.schedule.working) == 2
    first, task = c.transport.tasks[0]
    assert task.model_version == 0 and (task.round, task.attempt) == c.schedule.working[first]
    c.intake.on_update(buffer, first, _answer(c, first, 0, task.attempt, 0.1), time.time())
    c.topology.dispatch(c, c.schedule, buffer)  # the answer freed a slot
    assert len(c.transport.tasks) == 3 and len({(t.round, t.attempt) for _, t in c.transport.tasks}) == 3
    # task numbers continue after a restart: an answer to a lost task cannot pass for a new one's
    again = Engine("u", "digits_mlp", datasets.load("digits").test, c.settings, store=Store(tmp_path))
    assert again.schedule.ticket(again, "d0", again.schedule.open_buffer(again, 1), time.time() + 60) == 4


def test_releases_stay_retained_while_tasks_out_need_them(tmp_path):
    c, _ = _coordinator(tmp_path)
    c.transport = FakeSession()
    c.version = 4
    _task(c, "d1", 3, 1)  # a task out on version 3 (within S = 2 of version 4)
    c.releases.older.update({2: 1, 3: 1})  # versions 2 and 3 still retained
    c.schedule.retire_releases(c)  # nobody needs version 2: cleared at once
    assert sorted(c.releases.older) == [3] and c.transport.cleared == ["edgefl/u/model/2", "edgefl/u/model/2/0"]
    c.version = 6  # version 3 is now more than S versions behind: its updates would be dropped anyway
    c.schedule.retire_releases(c)
    assert c.releases.older == {} and c.transport.cleared[-2:] == ["edgefl/u/model/3", "edgefl/u/model/3/0"]


def test_simulate_buffered_applies_versions_from_stale_updates_and_drops_too_stale_ones(tmp_path):
    """Three agents, K = 1, S = 1: each accepted update is a version, so of the first wave of three
    answers the second arrives one version late (accepted, weighted 1/sqrt 2) and the third two late."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--mode", "buffered",
                             "--algorithm", "fedavg", "--agents", "3", "--rounds", "6", "--buffer-size", "1",
                             "--max-staleness", "1", "--local-epochs", "1", "--round-timeout", "30",
                             "--dataset", "digits", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    history = json.loads((out / "history.json").read_text())
    assert history["meta"]["mode"] == "buffered" and history["meta"]["buffer_size"] == 1
    rounds = history["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, 7)) and all(r["participants"] == 1 for r in rounds)
    assert all(rounds[i]["elapsed"] < rounds[i + 1]["elapsed"] for i in range(5))
    assert all(np.isfinite(r["accuracy"]) for r in rounds)
    folded = [m for r in rounds for m in r["devices"].values()]
    stale = [m for m in folded if m["staleness"] == 1]
    assert stale and all(m["staleness_factor"] == pytest.approx(1 / math.sqrt(2), abs=1e-4) for m in stale)
    assert all(m["staleness"] <= 1 for m in folded)
    dropped = sum(r["rejected"].get("too_stale", 0) for r in rounds)
    assert dropped >= 1  # each one logged at INFO (routine for a buffered schedule) and told to its device
    logs = "".join(p.read_text() for p in (out / "run" / "devices").glob("*/agent.log"))
    assert logs.count("rejected by the coordinator: too_stale") == dropped  # each dropped device was told why
