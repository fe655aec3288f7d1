import random
import time

import numpy as np
import pytest

from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.rounds import Round, RoundState
from broker_coordinator.engine.selection import select
from edgefl_protocol.transport import backoff_delay

SPECS = {"w": (3,)}


def test_streaming_mean_is_the_weighted_mean_in_any_order():
    deltas = [np.array([1.0, 2.0, 3.0], np.float32), np.array([-1.0, 0.0, 5.0], np.float32)]
    weights = [30.0, 10.0]
    expected = (30 * deltas[0] + 10 * deltas[1]) / 40
    for order in ([0, 1], [1, 0]):
        agg = StreamingMean(SPECS)
        for i in order:
            agg.add({"w": deltas[i]}, weights[i])
        assert np.allclose(agg.mean()["w"], expected)


def test_fednova_normalizes_by_local_steps():
    # d_k / a_k averaged with p_k, then scaled by tau_eff = sum p_k a_k
    agg = StreamingMean(SPECS, normalize_steps=True)
    agg.add({"w": np.array([4.0, 4.0, 4.0], np.float32)}, 1.0, steps=4)
    agg.add({"w": np.array([1.0, 1.0, 1.0], np.float32)}, 1.0, steps=1)
    tau_eff = (4 + 1) / 2
    assert np.allclose(agg.mean()["w"], tau_eff * (1.0 + 1.0) / 2)
    with pytest.raises(ValueError):
        agg.add({"w": np.zeros(3, np.float32)}, 0.0)


def test_empty_aggregate_refuses_to_average():
    with pytest.raises(ValueError, match="no updates"):
        StreamingMean(SPECS).mean()


def test_round_state_machine_rejects_illegal_transitions():
    rnd = Round(1, 1, {"a"}, time.time() + 5, 0, StreamingMean(SPECS))
    rnd.move(RoundState.COLLECTING)
    with pytest.raises(RuntimeError, match="collecting -> checkpointed"):
        rnd.move(RoundState.CHECKPOINTED)
    rnd.move(RoundState.CLOSED)
    for state in (RoundState.AGGREGATED, RoundState.EVALUATED, RoundState.CHECKPOINTED):
        rnd.move(state)
    with pytest.raises(RuntimeError):
        rnd.move(RoundState.ABANDONED)


def test_random_selection_is_a_uniform_sample_of_the_eligible():
    chosen = select("random", [f"d{i}" for i in range(10)], 4, random.Random(0), {})
    assert len(chosen) == 4 and len(set(chosen)) == 4


def test_stability_selection_prefers_stable_devices_but_keeps_half_random():
    eligible = [f"d{i}" for i in range(20)]
    unstable = {f"d{i}": {"tau": 0.5, "gamma": 0.1} for i in range(10)}
    stable = {f"d{i}": {"tau": 0.05, "gamma": 0.9} for i in range(10, 20)}
    counts = {"unstable": 0, "stable": 0}
    for seed in range(200):
        for d in select("stability", eligible, 8, random.Random(seed), {**unstable, **stable}):
            counts["unstable" if d in unstable else "stable"] += 1
    # the random half picks unstable devices about half the time (~2 of 8), the preferred half never does
    assert 0.15 < counts["unstable"] / (200 * 8) < 0.35


def test_backoff_grows_is_capped_and_jittered():
    rng = random.Random(1)
    first = [backoff_delay(0, 1.0, 60.0, rng) for _ in range(100)]
    late = [backoff_delay(20, 1.0, 60.0, rng) for _ in range(100)]
    assert all(0.5 <= d <= 1.0 for d in first)
    assert all(30.0 <= d <= 60.0 for d in late)
    assert len(set(round(d, 6) for d in late)) > 90  # no lock-step: every device waits differently


def _coordinator_and_round(tmp_path, **settings):
    from broker_coordinator.engine.loop import Engine
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.storage.store import Store
    from edgefl_models import datasets

    c = Engine("u", "digits_mlp", datasets.load("digits").test, RoundSettings(codec="float32", **settings),
                    store=Store(tmp_path),
                    device_keys={d: KEY for d in ("d1", "d2", "d9")})
    return c, Round(1, 1, {"d1", "d2"}, time.time() + 60, 0, RobustRound(c.specs, c.norm_bound))


KEY = b"unit-test-key-0123456789abcdef01"


def _signed(device, metrics, tensors):
    """A signed float32 update; the body is written by hand so that it may carry NaN."""
    import msgpack

    from edgefl_protocol import messages

    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    return messages.encode_update(messages.Update(device, 1, 0, 10, metrics, body, "float32", specs, "u"), KEY)


@pytest.mark.parametrize("metrics,body_fn,reason", [
    ({"steps": "many"}, None, "schema"),
    ({"steps": 0}, None, "schema"),
    ({"steps": 2}, lambda w: {k: np.full_like(v, np.nan) for k, v in w.items()}, "non_finite"),
    ({"steps": 2}, lambda w: {k: v[..., :1] for k, v in w.items()}, "shape"),
])
def test_bad_updates_are_counted_and_never_folded(tmp_path, metrics, body_fn, reason):
    c, rnd = _coordinator_and_round(tmp_path)
    zero = {k: np.zeros_like(v) for k, v in c.weights.items()}
    before = {k: v.copy() for k, v in c.weights.items()}
    c.intake.on_update(rnd, "d1", _signed("d1", metrics, body_fn(zero) if body_fn else zero), time.time())
    assert c.intake.rejections[reason] == 1 and rnd.aggregate.count == 0 and rnd.rejected[reason] == 1
    assert all(np.array_equal(before[k], c.weights[k]) for k in before)
    c.intake.on_update(rnd, "d2", _signed("d2", {"steps": 2}, zero), time.time())
    assert rnd.aggregate.count == 1  # the next good update is still accepted


def test_duplicate_and_unselected_updates_are_rejected(tmp_path):
    c, rnd = _coordinator_and_round(tmp_path)
    good = lambda d: _signed(d, {"steps": 1}, {k: np.zeros_like(v) for k, v in c.weights.items()})  # noqa: E731
    c.intake.on_update(rnd, "d1", good("d1"), time.time())
    c.intake.on_update(rnd, "d1", good("d1"), time.time())  # the same bytes again: a resend, answered, not folded
    other = _signed("d1", {"steps": 2}, {k: np.zeros_like(v) for k, v in c.weights.items()})
    c.intake.on_update(rnd, "d1", other, time.time())  # another update for the same round and attempt: a replay
    c.intake.on_update(rnd, "d9", good("d9"), time.time())
    c.intake.on_update(rnd, "d2", good("d1"), time.time())  # d2's topic, d1's claim
    assert (c.intake.rejections["replay"], c.intake.rejections["not_selected"], c.intake.rejections["sender"]) == (1, 1, 1)
    assert sum(c.intake.rejections.values()) == 3 and rnd.aggregate.count == 1


def test_an_update_queued_before_a_key_rotation_is_told_so_at_info_and_a_forgery_is_a_warning(tmp_path, caplog):
    """After `devices rotate` and the device's re-enrollment the coordinator holds its new key; an update
    the device queued before, signed with the old key, is rejected as `old_key` (routine: INFO). One
    signed with a key the device never had is still a `signature` warning."""
    c, rnd = _coordinator_and_round(tmp_path)
    zero = {k: np.zeros_like(v) for k, v in c.weights.items()}
    queued = _signed("d1", {"steps": 1}, zero)  # signed with KEY, the key before the rotation
    c.intake.rekey({**c.intake.keys, "d1": b"the-rotated-key-0123456789abcdef"})
    with caplog.at_level("INFO", logger="broker_coordinator"):
        c.intake.on_update(rnd, "d1", queued, time.time())
    (line,) = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert line.levelname == "INFO" and "d1's key from before it was rotated" in line.getMessage()
    assert c.intake.rejections["old_key"] == 1
    caplog.clear()
    c.intake.rekey({**c.intake.keys, "d2": b"another-new-key-0123456789abcdef"})
    forged = _signed("d2", {"steps": 1}, zero)
    c.intake.keys["d2"] = b"yet-another-key-0123456789abcdef"  # d2's key never was KEY after the first rekey
    c.intake.previous_keys["d2"] = b"an-older-key-000123456789abcdefg"
    with caplog.at_level("INFO", logger="broker_coordinator"):
        c.intake.on_update(rnd, "d2", forged, time.time())
    (line,) = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert line.levelname == "WARNING" and c.intake.rejections["signature"] == 1


def _update(c, device="d1", *, federation="u", model_version=0, codec_name="float32", scale=0.0):
    """A signed update with every field right unless a keyword says otherwise."""
    import msgpack

    from edgefl_protocol import messages

    tensors = {k: np.full_like(v, scale) for k, v in c.weights.items()}
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    return messages.encode_update(messages.Update(device, 1, model_version, 10, {"steps": 1}, body, codec_name,
                                                  specs, federation), KEY)


@pytest.mark.parametrize("fields,reason,detail", [
    ({"federation": "other"}, "federation", "federation 'other'"),
    ({"model_version": 7}, "stale", "model version 7"),
    ({"codec_name": "float16"}, "codec", "'float16'"),
    ({"scale": 1.0}, "norm", "exceeds the bound"),
])
def test_wrong_federation_model_codec_and_norm_are_rejected_with_their_reason(tmp_path, caplog, fields, reason,
                                                                                detail):
    c, rnd = _coordinator_and_round(tmp_path)
    c.settings.max_update_norm = 10.0  # a delta of all ones over 4,810 weights has norm ~69
    before = {k: v.copy() for k, v in c.weights.items()}
    with caplog.at_level("INFO"):  # a stale update is routine (INFO); the others are warnings
        c.intake.on_update(rnd, "d1", _update(c, **fields), time.time())
    assert c.intake.rejections[reason] == 1 and rnd.aggregate.count == 0
    assert any(detail in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert all(np.array_equal(before[k], c.weights[k]) for k in before)
    c.intake.on_update(rnd, "d2", _update(c, "d2"), time.time())
    assert rnd.aggregate.count == 1


def test_served_average_is_an_ema_of_global_models_and_survives_a_checkpoint(tmp_path):
    from broker_coordinator.aggregation.serving import ServedAverage
    from broker_coordinator.storage.store import Checkpoint, Store, model_sha256

    served = ServedAverage({"w": np.zeros(2, np.float32)}, 0.75)
    served.update({"w": np.array([4.0, 8.0], np.float32)})
    out = served.update({"w": np.array([4.0, 8.0], np.float32)})
    assert np.allclose(out["w"], [4 * (1 - 0.75 ** 2), 8 * (1 - 0.75 ** 2)])  # 1.75 and 3.5
    last = ServedAverage({"w": np.zeros(2, np.float32)}, 0.0)
    assert np.array_equal(last.update({"w": np.ones(2, np.float32)})["w"], np.ones(2))  # 0: the last model
    with pytest.raises(ValueError, match=r"serve_average must be in \[0, 1\)"):
        ServedAverage({}, 1.0)

    store = Store(tmp_path)
    weights = {"w": np.ones(2, np.float32)}
    store.save_checkpoint(Checkpoint(1, 1, "digits_mlp", weights, model_sha256(weights), {}, {}, dict(served.weights)))
    assert np.array_equal(Store(tmp_path).load_checkpoint().served["w"], served.weights["w"])


def test_coordinator_resumes_the_served_average_from_its_checkpoint(tmp_path):
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.storage.store import Checkpoint, Store, model_sha256
    from edgefl_models import datasets

    test = datasets.load("digits").test
    first = Engine("u", "digits_mlp", test, RoundSettings(serve_average=0.5), store=Store(tmp_path))
    weights = {k: v + 1 for k, v in first.weights.items()}
    served = {k: v + 0.5 for k, v in first.weights.items()}
    first.store.save_checkpoint(Checkpoint(3, 3, "digits_mlp", weights, model_sha256(weights), {}, {}, served))
    again = Engine("u", "digits_mlp", test, RoundSettings(serve_average=0.5), store=Store(tmp_path))
    assert again.next_round == 4
    assert all(np.array_equal(again.served.weights[k], served[k]) for k in served)
    with pytest.raises(ValueError, match="serve_average"):
        RoundSettings(serve_average=1.5).validate()


def test_the_default_codec_is_resolved_for_the_model_and_a_named_one_is_kept():
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol import codec

    assert RoundSettings().codec == codec.AUTO
    assert Engine("u", "digits_mlp", None, RoundSettings()).settings.codec == codec.DENSE  # 4,810 parameters
    assert Engine("u", "mnist_cnn", None, RoundSettings()).settings.codec == codec.DEFAULT  # 80,202
    assert Engine("u", "digits_mlp", None, RoundSettings(codec="topk0.1+q8")).settings.codec == "topk0.1+q8"


def _update_for(c, device, round_no=1, attempt=1, metrics=None, num_samples=10):
    import msgpack

    from edgefl_protocol import messages

    tensors = {k: np.zeros_like(v) for k, v in c.weights.items()}
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    return messages.encode_update(messages.Update(device, round_no, 0, num_samples, metrics or {"steps": 1}, body,
                                                  "float32", specs, "u", attempt), KEY)


def test_an_update_accepted_in_an_abandoned_attempt_may_answer_the_next_attempt(tmp_path):
    c, first = _coordinator_and_round(tmp_path)
    c.intake.on_update(first, "d1", _update_for(c, "d1", attempt=1), time.time())
    assert first.aggregate.count == 1
    second = Round(1, 2, {"d1", "d2"}, time.time() + 60, 0, RobustRound(c.specs, c.norm_bound))
    first.reason = "no quorum"
    c.intake.abandoned(first)  # what run_round does with an abandoned attempt: nothing it accepted was folded
    assert c.verdicts.of(("d1", 1, 1)).kind == "left_out"
    # the old attempt's answer again: answered with its verdict (left out), never folded into the new attempt
    c.intake.on_update(second, "d1", _update_for(c, "d1", attempt=1), time.time())
    assert not c.intake.rejections and second.aggregate.count == 0
    c.intake.on_update(second, "d1", _update_for(c, "d1", attempt=2), time.time())
    assert second.aggregate.count == 1 and not c.intake.rejections


def test_a_refusal_completes_the_device_and_its_reason_is_kept(tmp_path):
    from edgefl_protocol import messages
    c, rnd = _coordinator_and_round(tmp_path)
    refusal = messages.Refusal("d1", 1, 1, "task_settings", "local_epochs must be a whole number 0-100", "u")
    c.intake.on_update(rnd, "d1", messages.encode_refusal(refusal, KEY), time.time())
    c.intake.on_update(rnd, "d2", _update_for(c, "d2"), time.time())
    assert rnd.complete and rnd.refused == {"d1": "task_settings: local_epochs must be a whole number 0-100"}
    assert rnd.aggregate.count == 1


def test_long_string_metrics_and_unexpected_tensors_are_rejected_with_their_reason(tmp_path):
    import msgpack

    from edgefl_protocol import messages
    c, rnd = _coordinator_and_round(tmp_path)
    c.intake.on_update(rnd, "d1", _update_for(c, "d1", metrics={"steps": 1, "note": "x" * 1_000}), time.time())
    assert c.intake.rejections["schema"] == 1
    tensors = {**{k: np.zeros_like(v) for k, v in c.weights.items()}, "extra.smuggled": np.zeros(3, np.float32)}
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    data = messages.encode_update(messages.Update("d2", 1, 0, 10, {"steps": 1}, body, "float32", specs, "u"), KEY)
    c.intake.on_update(rnd, "d2", data, time.time())
    assert c.intake.rejections["shape"] == 1 and c.intake.rejections["oversized"] == 0 and rnd.aggregate.count == 0


def test_only_devices_the_registry_admits_are_selected(tmp_path):
    c, _ = _coordinator_and_round(tmp_path)
    c.presence.online = {"d1": {}, "d2": {}, "stranger": {}}
    c.intake.presence.admission = lambda d: None if d in ("d1", "d2") else ("unknown_device", f"{d} is not in the registry")
    assert sorted(c.presence.eligible()) == ["d1", "d2"]


def test_an_inflated_sample_count_does_not_buy_the_round(tmp_path):
    """The attack of issue 10: 2^62 claimed samples made the global step the attacker's delta."""
    c, rnd = _coordinator_and_round(tmp_path, algorithm="fedavg")  # size-weighted, as FedAvg is
    c.sample_weights.known = {"a": 100.0, "b": 100.0, "c": 100.0}
    c.sample_weights.start_round()
    c.intake.on_update(rnd, "d1", _update_for(c, "d1", num_samples=2**62), time.time())
    c.intake.on_update(rnd, "d2", _update_for(c, "d2", num_samples=100), time.time())
    assert rnd.device_metrics["d1"]["weight"] == 200.0 and rnd.weights_clipped == 1


def test_presence_is_written_once_per_drain_tick_and_flushed_on_close(tmp_path):
    """A reconnect delivers every device's retained status at once: the store writes them in one
    transaction when the inbox goes quiet (the old code autocommitted one write per status), and
    a status still buffered at shutdown is written by close."""
    from broker_coordinator.storage.store import Store
    from edgefl_protocol import messages, topics

    c, _ = _coordinator_and_round(tmp_path)
    transactions, open_tx = [], [False]

    def trace(sql: str) -> None:
        word = sql.lstrip().split(None, 1)[0].upper()
        if word == "BEGIN":
            open_tx[0] = True
            transactions.append(sql)
        elif word in ("COMMIT", "ROLLBACK"):
            open_tx[0] = False
        elif word in ("INSERT", "UPDATE", "DELETE") and not open_tx[0]:
            transactions.append(sql)  # an autocommitted write is a transaction of its own

    c.store.db.set_trace_callback(trace)
    for i in range(50):
        status = messages.Status(f"dev-{i}", "online", {"busy": False})
        c.transport.inbox.put((topics.status("u", f"dev-{i}"), messages.encode("status", status), time.time(), True))
    while not c.transport.inbox.empty():
        c.drain(0.0)
    assert not transactions  # buffered while the statuses keep coming
    c.drain(0.0)  # the inbox is quiet: one transaction
    assert len(transactions) == 1 and len(c.store.devices()) == 50
    offline = messages.Status("dev-3", "offline")
    c.transport.inbox.put((topics.status("u", "dev-3"), messages.encode("status", offline), time.time(), False))
    c.drain(0.0)
    c.store.close()  # shutdown before the next quiet tick
    rows = {d["device"]: d for d in Store(tmp_path).devices()}
    assert rows["dev-3"]["online"] == 0 and rows["dev-3"]["profile"]  # the last state, its profile kept
    assert len(rows) == 50 and all(rows[f"dev-{i}"]["online"] for i in range(50) if i != 3)


@pytest.mark.parametrize("bound", [0.0, 1e6])
def test_an_updates_norm_is_computed_once_with_or_without_a_hard_bound(tmp_path, monkeypatch, bound):
    """Intake's hard bound needs the delta's norm, and so does the robust fold: it is computed once
    and handed on (the old code computed it in intake.py and again in RobustRound.add)."""
    from broker_coordinator.engine import intake
    from broker_coordinator.aggregation import robust

    c, rnd = _coordinator_and_round(tmp_path)
    c.settings.max_update_norm = bound
    norms, real = [], robust.l2_norm
    counted = lambda tensors: norms.append(real(tensors)) or norms[-1]  # noqa: E731
    monkeypatch.setattr(intake, "l2_norm", counted)
    monkeypatch.setattr(robust, "l2_norm", counted)
    c.intake.on_update(rnd, "d1", _update(c), time.time())
    assert rnd.aggregate.count == 1 and len(norms) == 1
