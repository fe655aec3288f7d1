"""The fold's verdict is what everyone sees (issue 20): a device learns whether its update was folded,
clipped (to what, with the scale) or left out (why), commits state only for what was folded, as it was
folded; an update whose receipt was lost counts exactly once; device_rounds, the round record, `status`
and Prometheus carry the same verdicts."""

from __future__ import annotations

import sqlite3
import threading
import time

import msgpack
import numpy as np
import pytest

from bench.inmemory import InMemoryFederation
from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.rounds import RoundState
from broker_coordinator.engine.transport import InMemoryTransport
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.in_memory import fold_round
from broker_coordinator.simulation.private_broker import PrivateBroker
from broker_coordinator.simulation.simulate import (
    SimulationSpec,
    spawn_agent,
    stop_processes,
    write_agent_config,
)
from broker_coordinator.storage.store import Store
from edge_agent.delivery import Delivery
from edge_agent.settlement import Sent, Settlement
from edge_agent.state import DeviceState
from edgefl_protocol import codec, messages, signing
from edgefl_models import datasets

FED = "vd"
KEY = signing.new_key()
DEVICES = ("d1", "d2", "d3", "d4")


class Receipts(InMemoryTransport):
    """An in-memory transport that keeps the receipts the coordinator publishes: device -> [Receipt, ...]."""

    def __init__(self) -> None:
        super().__init__()
        self.got: dict[str, list[messages.Receipt]] = {}

    def publish(self, topic, payload, retain=False):  # noqa: ANN001
        if topic.endswith("/receipt"):
            self.got.setdefault(topic.split("/")[3], []).append(messages.decode_receipt(payload))


def _coordinator(tmp_path, **settings) -> Engine:
    s = RoundSettings(**{"algorithm": "fedavg", "codec": "float32", **settings})
    c = Engine(FED, "digits_mlp", datasets.load("digits").test, s, store=Store(tmp_path / "state"),
                    device_keys={d: KEY for d in DEVICES})
    c.transport = Receipts()
    return c


def _update(c, device, tensors, round_no=1, attempt=1, metrics=None) -> bytes:
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    return messages.encode_update(messages.Update(device, round_no, c.version, 10, metrics or {"steps": 1}, body,
                                                  "float32", specs, FED, attempt), KEY)


def _direction(c, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in c.weights.items()}


def test_a_clipped_update_is_told_its_scale_in_the_one_receipt(tmp_path):
    c = _coordinator(tmp_path, aggregator="mean", norm_bound=1.5)
    for _ in range(5):
        c.norm_bound.record(1.0)  # a warm history: the bound is 1.5
    d = _direction(c)
    norm = float(np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in d.values())))
    delta = {k: a * (3.0 / norm) for k, a in d.items()}  # norm 3: twice the bound
    rnd = c.open_round(1, 1, {"d1"}, time.time() + 60, 1)
    c.intake.on_update(rnd, "d1", _update(c, "d1", delta), time.time())
    (receipt,) = c.transport.got["d1"]  # streaming: decided at intake, one message
    assert receipt.accepted and receipt.verdict == "clipped" and receipt.scale == pytest.approx(0.5, rel=1e-3)
    assert "norm 3 -> 1.5" in receipt.detail


def test_an_update_folded_below_its_full_weight_is_told_its_share_and_why(tmp_path):
    """A device flagged in earlier rounds (the agreement stage) is folded at a share of its claimed
    weight: its receipt, its row in device_rounds, the round record and Prometheus say which share
    and why, while its delta is folded as sent (scale 1: it commits all of it)."""
    c = _coordinator(tmp_path, aggregator="centered_clip")
    c.consensus.flags["d1"] = [1, 1]  # two flags in its last rounds
    share = c.consensus.of("d1")
    rnd = c.open_round(1, 1, {"d1", "d2", "d3"}, time.time() + 60, 3)
    rnd.move(RoundState.COLLECTING)
    for k, device in enumerate(("d1", "d2", "d3")):
        c.intake.on_update(rnd, device, _update(c, device, _direction(c, seed=k)), time.time())
    rnd.move(RoundState.CLOSED)
    record = c.conclude(rnd, "base")
    told = c.transport.got["d1"][-1]
    assert told.accepted and told.verdict in ("folded", "clipped") and told.detail.endswith(
        f"weighed at {share:.2f} of its claim: its updates pointed away from their rounds before (agreement)")
    assert c.verdicts.of(("d1", 1, 1)).weight == pytest.approx(share)
    assert "weighed at" not in c.transport.got["d2"][-1].detail
    assert record.devices["d1"]["weight_share"].startswith(f"{share:.2f} (its updates pointed away")
    assert record.clipped["reduced_weight"] == 1
    assert c.metrics.bounded.labels("reduced_weight")._value.get() == 1
    detail = c.store.db.execute("SELECT verdict_detail FROM device_rounds WHERE round = 1 AND device = 'd1'")
    assert "weighed at" in detail.fetchone()[0]


def test_a_coordinator_killed_before_its_round_was_saved_takes_its_verdicts_back(tmp_path):
    """Two devices are told "folded" as their updates arrive; the coordinator dies before the round is
    saved. The next run resumes from the last saved round and tells both that their updates are in
    no model (left_out), so they undo what they committed before they train the round again."""
    c = _coordinator(tmp_path, aggregator="mean")
    for _ in range(5):
        c.norm_bound.record(1.0)  # a warm history: verdicts are given on arrival, not held for a cold start
    rnd = c.open_round(1, 1, {"d1", "d2", "d3"}, time.time() + 60, 3)
    rnd.move(RoundState.COLLECTING)
    for device in ("d1", "d2"):
        c.intake.on_update(rnd, device, _update(c, device, _direction(c)), time.time())
    assert [r.verdict for r in c.transport.got["d1"]] == ["folded"]
    # killed here: no checkpoint, no round record; the next run opens the same state
    again = _coordinator(tmp_path, aggregator="mean")
    assert again.next_round == 1
    again.take_back_unsaved()
    for device in ("d1", "d2"):
        (told,) = again.transport.got[device]
        assert (told.round, told.attempt, told.accepted, told.verdict, told.scale) == (1, 1, True, "left_out", 0.0)
        assert "restarted before round 1 was saved" in told.detail
    third = _coordinator(tmp_path, aggregator="mean")  # taken back once: a later restart says nothing again
    third.take_back_unsaved()
    assert third.transport.got == {}


def test_a_saved_rounds_verdicts_are_never_taken_back(tmp_path):
    c = _coordinator(tmp_path, aggregator="mean")
    rnd = c.open_round(1, 1, {"d1"}, time.time() + 60, 1)
    rnd.move(RoundState.COLLECTING)
    c.intake.on_update(rnd, "d1", _update(c, "d1", _direction(c)), time.time())
    rnd.move(RoundState.CLOSED)
    c.conclude(rnd, "base")
    again = _coordinator(tmp_path, aggregator="mean")
    assert again.next_round == 2
    again.take_back_unsaved()
    assert again.transport.got == {}


def test_a_reversed_update_is_left_out_by_gated_mean_and_told_so_after_the_close(tmp_path):
    c = _coordinator(tmp_path, aggregator="gated_mean", norm_bound=0)
    d = _direction(c)
    rng = np.random.default_rng(1)
    answers = {dev: _update(c, dev, {k: a + rng.normal(0, 0.001, a.shape).astype(np.float32) for k, a in d.items()})
               for dev in DEVICES[:3]}
    answers["d4"] = _update(c, "d4", {k: -a for k, a in d.items()})  # reversed
    for dev in DEVICES:
        c.store.record_presence(dev, True, {})
    record = fold_round(c, answers, 1)
    first, final = c.transport.got["d4"]
    assert first.accepted and first.verdict == "pending"  # gated_mean decides at the close
    assert final.accepted and final.verdict == "left_out" and final.scale == 0 and "direction" in final.detail
    assert [r.verdict for r in c.transport.got["d1"]] == ["pending", "folded"]
    # the round record, device_rounds, status and Prometheus say the same
    assert record.left_out == pytest.approx(0.25) and record.clipped == {"direction": 1}
    assert record.devices["d4"]["verdict"] == "left_out"
    assert c.metrics.registry.get_sample_value("edgefl_round_left_out_fraction") == pytest.approx(0.25)
    rows = dict(c.store.db.execute("SELECT device, verdict FROM device_rounds").fetchall())
    assert rows == {"d1": "folded", "d2": "folded", "d3": "folded", "d4": "left_out"}
    assert c.store.rounds()[-1]["left_out"] == pytest.approx(0.25)
    counts = {d["device"]: (d["folded"], d["clipped"], d["left_out"]) for d in c.store.devices()}
    assert counts["d4"] == (0, 0, 1) and counts["d1"] == (1, 0, 0)


def test_status_shows_rounds_folded_clipped_and_left_out(tmp_path):
    from broker_coordinator.cli.service import status
    from broker_coordinator.settings.config import load_config
    from edgefl_protocol.settings import to_toml
    test_a_reversed_update_is_left_out_by_gated_mean_and_told_so_after_the_close(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text(to_toml({"federation": {"name": FED, "model": "digits_mlp", "test_data": "unused.npz"},
                               "broker": {"password": "x"}, "storage": {"state_dir": str(tmp_path / "state")}}))
    lines: list[str] = []
    status(load_config(config, with_rounds=False), lines.append)
    d4 = next(line for line in lines if "d4" in line)
    assert "rounds folded 0, clipped 0, left out 1" in d4


def test_an_identical_resend_after_the_close_gets_its_verdict_and_an_unknown_one_its_rejection(tmp_path):
    c = _coordinator(tmp_path, aggregator="mean", norm_bound=0)
    payload = _update(c, "d1", _direction(c))
    fold_round(c, {"d1": payload}, 1)
    rnd = c.open_round(2, 1, {"d1"}, time.time() + 60, 1)
    c.intake.on_update(rnd, "d1", payload, time.time())  # its receipt was lost: the same bytes, after the close
    assert c.transport.got["d1"][-1].accepted and c.transport.got["d1"][-1].verdict == "folded"
    assert not c.intake.rejections and rnd.aggregate.count == 0
    c.intake.on_update(rnd, "d2", _update(c, "d2", _direction(c)), time.time())  # never accepted for round 1
    late = c.transport.got["d2"][-1]
    assert not late.accepted and late.reason == "late" and late.verdict == "not_folded"


def test_an_update_that_owes_a_folded_one_is_logged_as_a_double_count(tmp_path, caplog):
    c = _coordinator(tmp_path, aggregator="mean", norm_bound=0)
    fold_round(c, {"d1": _update(c, "d1", _direction(c))}, 1)
    twice = _update(c, "d1", _direction(c, 2), round_no=2, metrics={"steps": 1, "owed": "1.1"})
    record = fold_round(c, {"d1": twice}, 2)
    assert "counts twice" in caplog.text and record.devices["d1"]["double_count"] == "1.1"


def test_an_old_device_rounds_table_gets_the_verdict_columns(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    db = sqlite3.connect(tmp_path / "coordinator.db")
    db.execute("CREATE TABLE device_rounds (round INTEGER NOT NULL, attempt INTEGER NOT NULL, device TEXT NOT NULL, "
               "accepted INTEGER NOT NULL, reason TEXT, metrics TEXT, at REAL NOT NULL)")
    db.execute("INSERT INTO device_rounds VALUES (1, 1, 'd1', 1, NULL, NULL, 0)")
    db.commit()
    db.close()
    store = Store(tmp_path)
    store.record_presence("d1", True, {})
    (row,) = store.devices()
    assert (row["folded"], row["left_out"], row["unjudged"]) == (0, 0, 1)  # recorded before verdicts


def _federation(tamper, algorithm="feddyn"):
    data = datasets.load("digits")
    shards = [data.train.subset(np.arange(i * 150, (i + 1) * 150)) for i in range(6)]
    settings = RoundSettings(algorithm=algorithm, codec="float32", aggregator="gated_mean", norm_bound=1.5,
                             local_epochs=1, batch_size=32)
    return InMemoryFederation("digits_mlp", shards, data.test, settings, clients_per_round=6, tamper=tamper)


def test_a_device_commits_the_clipped_delta_and_a_left_out_one_commits_nothing():
    sent: dict[str, dict] = {}

    def tamper(device, delta, num_samples, round_no):
        factor = {"dev-004": 5.0, "dev-005": -1.0}.get(device, 1.0)  # inflated; reversed
        sent[device] = {k: (v * factor).astype(np.float32) for k, v in delta.items()}
        return sent[device], num_samples

    fed = _federation(tamper)
    fed.round(1)
    verdicts = {d: fed.coordinator.verdicts.of((d, 1, 1)) for d in fed.devices}
    assert verdicts["dev-005"].kind == "left_out"
    assert "h" not in fed.states["dev-005"].get("feddyn", {})  # the dual stays as it was (none yet)
    clipped = verdicts["dev-004"]
    assert clipped.kind == "clipped" and 0 < clipped.scale < 0.5
    names = [k for k in sent["dev-004"] if not k.startswith("extra.")]
    for h, name in zip(fed.states["dev-004"]["feddyn"]["h"], names):  # h = 0 + s x what the server decoded
        np.testing.assert_allclose(h, clipped.scale * sent["dev-004"][name], rtol=1e-4, atol=1e-7)


def test_a_lost_receipt_and_the_next_round_count_the_update_exactly_once(tmp_path):
    """dev-a is a real agent process; the coordinator folds its round 1 update but publishes no receipt
    for it in round 1. In round 2 the agent resends that payload before training, is told "folded",
    commits it, and does not owe it again: its round 2 update (trained at a learning rate 10^4 times
    smaller) carries nothing of round 1's delta. Today's agent owed the whole delta and sent it again."""
    data = datasets.load("digits")
    shard = tmp_path / "dev-a" / "data.npz"
    datasets.save_npz(shard, data.train.subset(np.arange(300)))
    keys = {"dev-a": signing.new_key()}
    settings = RoundSettings(algorithm="fedavg", round_timeout=120, local_epochs=1, codec="topk1+float32",
                             lr_decay=1e-4, weight_decay=0.0, model_chunk_bytes=1 << 20)

    broker = PrivateBroker(tmp_path / "broker", FED)
    broker.add_user(COORDINATOR_USER)
    broker.add_user("dev-a")
    with broker:
        coordinator = Engine(FED, "digits_mlp", data.test, settings, device_keys=keys)
        dropping, norms = [True], {}
        receipt, fold = coordinator.intake._receipt, coordinator.intake._fold

        def losing_receipt(device, answer, rejected, verdict=None):  # noqa: ANN001 (round 1's receipt is lost)
            if not (dropping[0] and answer == (1, 1)):
                receipt(device, answer, rejected, verdict)

        def measuring_fold(current, device, answer, judged, size, digest):  # noqa: ANN001
            if isinstance(answer, messages.Update):
                norms[answer.round] = float(np.sqrt(sum(np.sum(judged[0][n].astype(np.float64) ** 2)
                                                        for n in coordinator.specs)))
            fold(current, device, answer, judged, size, digest)

        coordinator.intake._receipt, coordinator.intake._fold = losing_receipt, measuring_fold
        coordinator.connect(broker.host, broker.port, COORDINATOR_USER, broker.users[COORDINATOR_USER])
        config = tmp_path / "dev-a" / "agent.toml"
        write_agent_config(config, "dev-a", broker.users["dev-a"], broker.port,
                           SimulationSpec(federation=FED, agent_threads=1), shard, keys["dev-a"])
        agent = spawn_agent(config, tmp_path / "dev-a" / "agent.log")
        try:
            coordinator.wait_for_devices(1, 60)
            first = coordinator.run_round(1)
            dropping[0] = False
            second = coordinator.run_round(2)
            give_up = time.monotonic() + 60  # the last receipt: the agent logs its verdict
            while "round 2: update accepted" not in (tmp_path / "dev-a" / "agent.log").read_text():
                assert time.monotonic() < give_up
                coordinator.drain(0.2)
        finally:
            stop_processes([agent])
            coordinator.close()
    log = (tmp_path / "dev-a" / "agent.log").read_text()
    assert (first.participants, second.participants) == (1, 1), log
    assert "the round 1 update settled: folded" in log, log
    assert coordinator.verdicts.of(("dev-a", 1, 1)).kind == "folded"
    assert "owed" not in second.devices["dev-a"] and "double_count" not in second.devices["dev-a"]
    assert norms[2] < 0.05 * norms[1], norms  # round 1's delta is not in it



class _Dual:
    """A client rule whose committed state is the decoded delta it was told was folded (a dual's shape)."""

    def __init__(self, before: dict) -> None:
        self.state = dict(before)

    def committed(self, decoded: dict) -> None:
        self.state = {"h": [a.copy() for a in decoded.values()]}


def _device(state_dir) -> Settlement:  # noqa: ANN001
    """The agent's settlement with what it declares: its state, a delivery (nothing is published: a
    resend finds no broker) and where rejected downlink counts go back."""
    delivery = Delivery(lambda topic, payload, deadline: False, "update", threading.Event(), lambda: False)
    return Settlement(DeviceState(state_dir), delivery, lambda down: None)


def _committed_update(tmp_path) -> tuple[Settlement, dict]:
    """A device whose round 4 update was received as folded: its dual holds the delta."""
    device = _device(tmp_path / "state")
    before = {"h": [np.zeros(3, np.float32)]}
    device.state.data["feddyn"] = before
    delta = {"w": np.array([0.1, -0.2, 0.3], np.float32)}
    sent = Sent(messages.Task(4, 0, time.time() + 60, "feddyn"), b"", "feddyn", _Dual(before), before, delta,
                codec.encode(delta, "float32"), None, {})
    assert device.settle(sent, messages.Receipt(4, 1, True, verdict="folded")) == "folded"
    np.testing.assert_allclose(device.state.data["feddyn"]["h"][0], delta["w"])
    return device, delta


def test_a_commit_overtaken_by_its_rounds_abandonment_is_undone_before_the_next_training(tmp_path):
    """A streaming fold says "folded" on arrival; the round is then abandoned and a second receipt says
    left_out. Before its next training the agent settles that update again: the dual is what it was."""
    device, _ = _committed_update(tmp_path)
    device.delivery.receive(messages.Receipt(4, 1, True, detail="round 4 abandoned: quorum", verdict="left_out"))
    device.settle_unsettled(messages.Task(5, 0, time.time() + 60, "feddyn"))
    np.testing.assert_allclose(device.state.data["feddyn"]["h"][0], 0.0)
    assert device.committed is None and (4, 1) not in device.delivery.receipts


def test_a_commit_with_no_later_receipt_stands(tmp_path):
    device, delta = _committed_update(tmp_path)
    device.settle_unsettled(messages.Task(5, 0, time.time() + 60, "feddyn"))
    np.testing.assert_allclose(device.state.data["feddyn"]["h"][0], delta["w"])


def test_a_retried_attempt_does_not_send_the_rejected_attempts_delta_beside_its_own_retraining(tmp_path):
    """Top-k: attempt 1 of round 4 is rejected, so its whole delta is owed (in the residual). Attempt 2
    of round 4, from the same model, trains that delta again: the owed copy is dropped before it
    trains, the residual is what it was before attempt 1, and nothing claims the attempt-1 update."""
    device = _device(tmp_path / "state")
    earlier = {"w": np.array([0.01, 0.0, -0.02], np.float32)}  # what top-k had not sent before round 4
    delta = {"w": np.array([0.1, -0.2, 0.3], np.float32)}
    encoded = codec.encode({"w": delta["w"] + earlier["w"]}, "topk0.34+float32")
    sent = Sent(messages.Task(4, 7, time.time() + 60, "fedavg", codec="topk0.34+float32"), b"", "fedavg", _Dual({}), {},
                delta, encoded, earlier, {})
    assert device.settle(sent, messages.Receipt(4, 1, False, "late", "round 4 closed")) == "rejected"
    codec_state = device.state.data["codec"]
    np.testing.assert_allclose(codec_state["residual"]["w"], delta["w"] + earlier["w"])  # owed, today's rule
    assert codec_state["owed"] == ["4.1"]
    device.settle_unsettled(messages.Task(4, 7, time.time() + 60, "fedavg", attempt=2))
    np.testing.assert_allclose(device.state.data["codec"]["residual"]["w"], earlier["w"])
    assert "owed" not in device.state.data["codec"] and "retry" not in device.state.data["codec"]


def test_an_owed_delta_stays_owed_into_the_next_round(tmp_path):
    """The next round trains from a new model: the rejected update's delta is still owed there."""
    device = _device(tmp_path / "state")
    delta = {"w": np.array([0.1, -0.2, 0.3], np.float32)}
    sent = Sent(messages.Task(4, 7, time.time() + 60, "fedavg", codec="topk0.34+float32"), b"", "fedavg", _Dual({}), {},
                delta, codec.encode(delta, "topk0.34+float32"), None, {})
    device.settle(sent, messages.Receipt(4, 1, False, "late", "round 4 closed"))
    device.settle_unsettled(messages.Task(5, 8, time.time() + 60, "fedavg"))
    np.testing.assert_allclose(device.state.data["codec"]["residual"]["w"], delta["w"])
    assert device.state.data["codec"]["owed"] == ["4.1"]


def test_status_shows_a_revoked_device_as_revoked_not_online(tmp_path):
    """Revoking drops a device's broker login, and its last will (on a topic its ACL no longer grants)
    never lands, so its stored presence still says online: status must say revoked."""
    from broker_coordinator.access.registry import Registry
    from broker_coordinator.cli.service import status
    from broker_coordinator.settings.config import load_config
    from edgefl_protocol.settings import to_toml
    test_a_reversed_update_is_left_out_by_gated_mean_and_told_so_after_the_close(tmp_path)  # d1-d4 online
    config = tmp_path / "c.toml"
    config.write_text(to_toml({"federation": {"name": FED, "model": "digits_mlp", "test_data": "unused.npz"},
                               "broker": {"password": "x"}, "storage": {"state_dir": str(tmp_path / "state")}}))
    loaded = load_config(config, with_rounds=False)
    registry = Registry(loaded.registry_path)
    for device in DEVICES:
        registry.add(device, FED, "hash", "00", f"token-{device}", time.time() + 60)
        registry.activate(device, f"token-{device}", "hash")
    registry.revoke("d4")
    lines: list[str] = []
    status(loaded, lines.append)
    assert f"devices: {len(DEVICES) - 1} online of {len(DEVICES)} seen (1 of them revoked)" in lines
    assert " revoked " in next(line for line in lines if "d4" in line)
    assert " online " in next(line for line in lines if "d1" in line)


def test_a_cleared_retained_status_is_stored_as_offline(tmp_path):
    """`devices revoke` and `rotate` clear the device's retained status (the broker drops the session
    without its will): the stored presence, which status reads, must say offline too."""
    c = _coordinator(tmp_path, aggregator="mean", norm_bound=0)
    c.store.record_presence("d1", True, {"cores": 4})
    c.presence.on_status("d1", b"")
    (row,) = [d for d in c.store.devices() if d["device"] == "d1"]
    assert row["online"] == 0 and "cores" in row["profile"]  # offline, its last profile kept


def test_devices_asked_to_evaluate_that_report_nothing_get_one_warning_that_says_what_to_do(tmp_path, caplog):
    """No test set, so the devices evaluate; agents enrolled with the `[device] data` shorthand hold out
    nothing and report no score. The coordinator says so once, with the setting that fixes it."""
    c = Engine(FED, "digits_mlp", None, RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean"),
                    store=Store(tmp_path / "state"), device_keys={d: KEY for d in DEVICES})
    c.transport = Receipts()
    for round_no in (1, 2):
        fold_round(c, {"d1": _update(c, "d1", _direction(c), round_no=round_no)}, round_no)
    said = [r.getMessage() for r in caplog.records if "none reported a score" in r.getMessage()]
    assert len(said) == 1 and "[data] holdout" in said[0] and "test_data" in said[0]
