"""What a device's update may weigh and how far it may move the model (trust.py, robust.py),
and the checkpoint history behind `rollback` (store.py). Units: no broker needed."""

import sqlite3
import time

import numpy as np
import pytest

from broker_coordinator.aggregation.held_folds import geometric_median, trimmed_mean
from broker_coordinator.aggregation.robust import OUTLIER_SHARE, RobustRound
from broker_coordinator.aggregation.trust import GROWTH, NormBound, SampleWeights

SPECS = {"w": (4,)}


def test_a_claimed_sample_count_cannot_outweigh_the_federation():
    weights = SampleWeights("capped", cap_factor=2.0)
    weights.start_round()  # cold start: nobody is known, every weight of the round is 1
    assert [weights.weigh(d, n).weight for d, n in [("a", 100), ("b", 200), ("c", 300), ("x", 2**62)]] == [1] * 4
    weights.start_round()  # now the median of trusted counts (250) bounds everyone
    assert weights.weigh("a", 100).weight == 100
    inflated = weights.weigh("x", 2**62)
    assert inflated.weight == pytest.approx(2 * 250) and "clipped" in inflated.note
    weights.start_round()
    jump = weights.weigh("a", 10_000)  # a device's own count may not jump more than 2x per report
    assert jump.weight == 200 and "jumped from 100" in jump.note


def test_uniform_and_reported_weights():
    assert SampleWeights("uniform").weigh("a", 500).weight == 1.0
    assert SampleWeights("reported").weigh("a", 500).weight == 500.0
    with pytest.raises(ValueError, match="weighting must be one of"):
        SampleWeights("loudest")


def test_weights_and_norm_history_survive_a_checkpoint():
    weights, bound = SampleWeights(), NormBound(window=3)
    weights.known = {"a": 10.0}
    for n in (1.0, 2.0, 3.0, 4.0):
        bound.record(n)
    again_w, again_b = SampleWeights(), NormBound(window=3)
    again_w.load_state(weights.state())
    again_b.load_state(bound.state())
    assert again_w.known == {"a": 10.0} and list(again_b.history) == [2.0, 3.0, 4.0]


def test_a_huge_delta_is_clipped_to_the_median_of_recent_norms():
    bound = NormBound(multiplier=1.5, warmup=3)
    for n in (1.0, 1.0, 1.0):
        bound.record(n)
    rnd = RobustRound(SPECS, bound, "mean")
    rnd.add("honest", {"w": np.full(4, 0.5, np.float32)}, 1.0)  # norm 1
    rnd.add("attacker", {"w": np.full(4, 5e5, np.float32)}, 1.0)  # norm 1e6
    mean = rnd.result()["w"]
    assert np.allclose(mean, (0.5 + 1.5 * 0.5) / 2)  # clipped to norm 1.5, same direction
    assert rnd.clipped["attacker"] == (pytest.approx(1e6), pytest.approx(1.5))
    assert max(bound.history) == pytest.approx(1.5)  # the history records the clipped norm, not the claim


@pytest.mark.parametrize("aggregator", ["mean", "centered_clip"])
def test_a_cold_start_holds_only_warmup_updates_and_clips_them_against_their_own_median(aggregator):
    rnd = RobustRound(SPECS, NormBound(multiplier=1.5, warmup=5), aggregator)
    for i in range(4):
        rnd.add(f"d{i}", {"w": np.full(4, 0.5, np.float32)}, 1.0)
    assert len(rnd.held) == 4
    rnd.add("attacker", {"w": np.full(4, -1e6, np.float32)}, 1.0)
    assert rnd.held == [] and rnd.stream.count + rnd.outliers.count == 5  # the fifth flushes the hold
    for i in range(50):
        rnd.add(f"e{i}", {"w": np.full(4, 0.5, np.float32)}, 1.0)
        assert rnd.held == []
    mean = rnd.result()["w"]
    if aggregator == "mean":  # the attacker clipped to 1.5 x the median norm of the five
        assert np.allclose(mean, (54 * 0.5 - 0.75) / 55)
    else:  # and centred on the five's median, a hair's radius from it: it barely moves the round
        assert rnd.provisional and "attacker" in rnd.centered
        assert np.allclose(mean, 0.5, atol=1e-4)


def test_a_device_sending_zeros_round_after_round_cannot_collapse_the_bound():
    bound = NormBound(multiplier=1.5, warmup=3)
    for i in range(5):
        bound.record(1.0, f"honest-{i}")
    for _ in range(200):  # one device, a zero delta every round (issue: 46 such rounds froze a federation)
        bound.record(0.0, "quiet")
    assert bound.bound() == pytest.approx(1.5)
    assert len(bound.history) == 6


@pytest.mark.parametrize("aggregator", ["mean", "centered_clip"])
def test_a_history_of_zeros_neither_freezes_the_federation_nor_lets_the_bounded_pull_the_bound_up(aggregator):
    """Issue 20: 46 rounds of zero deltas left the history at median 0 and every later honest update was
    clipped to nothing, for good (the recorded norms were the clipped ones). Now honest entries grow back
    by at most GROWTH per record, so the bound (and centered_clip's radius) recovers in a few rounds."""
    zeros = {"by_device": {f"d{i}": 0.0 for i in range(10)}}
    bound, radius = NormBound(multiplier=1.5), NormBound(multiplier=1.5)
    bound.load_state(zeros)
    radius.load_state(zeros)
    center = {"w": np.zeros(4, np.float32)} if aggregator == "centered_clip" else None
    honest = {"w": np.full(4, 0.2, np.float32)}  # norm 0.4, distance 0.4 from the centre
    means = []
    for _ in range(12):
        rnd = RobustRound(SPECS, bound, aggregator, center=center, radius=radius)
        for i in range(10):
            rnd.add(f"d{i}", honest, 1.0)
        means.append(float(rnd.result()["w"][0]))
    assert means[0] > 0  # never clipped to nothing
    assert means[-1] == pytest.approx(0.2) and not rnd.clipped and not rnd.centered  # recovered
    # one device's entry rises by at most GROWTH per record: a huge claim cannot drag the bound up
    bound = NormBound(multiplier=1.5)
    for i in range(9):
        bound.record(1.0, f"h{i}")
    for _ in range(3):
        bound.observe(1e6, "liar", bound.bound())
    assert bound.by_device["liar"] == pytest.approx(1.5 * GROWTH ** 2) and bound.bound() == pytest.approx(1.5)


def test_centered_clip_bounds_what_a_reversed_update_moves_away_from_the_centre():
    center = {"w": np.full(4, 0.5, np.float32)}
    radius = NormBound(multiplier=1.5, warmup=3)
    for i in range(3):
        radius.record(0.2, f"h{i}")
    rnd = RobustRound(SPECS, NormBound(multiplier=0), "centered_clip", center=center, radius=radius)
    honest = {"w": np.full(4, 0.55, np.float32)}  # distance 0.1 from the centre: kept as it is
    for i in range(4):
        rnd.add(f"d{i}", honest, 1.0)
    rnd.add("attacker", {"w": np.full(4, -0.5, np.float32)}, 1.0)  # distance 2.0 from the centre
    distance, tau = rnd.centered["attacker"]
    # the radius: 1.5 x the median distance of earlier rounds, fixed for the round
    assert distance == pytest.approx(2.0) and tau == pytest.approx(1.5 * 0.2)
    pulled = 0.5 - tau / 2  # c + tau * unit(delta - c): each of 4 coordinates moves tau / 2
    share = OUTLIER_SHARE / (1 - OUTLIER_SHARE) * 4  # what is left of its weight 1: the clipped hold 10%
    assert np.allclose(rnd.result()["w"], (4 * 0.55 + share * pulled) / (4 + share), atol=1e-6)
    assert set(rnd.centered) == {"attacker"} and rnd.outlier_scale == pytest.approx(share)


@pytest.mark.parametrize("aggregator", ["trimmed_mean", "median", "geomed"])
def test_robust_aggregators_ignore_a_minority_of_outliers(aggregator):
    bound = NormBound(multiplier=0)  # no clipping: the aggregator alone
    rnd = RobustRound(SPECS, bound, aggregator, trim=0.2)
    for i in range(8):
        rnd.add(f"d{i}", {"w": np.full(4, 1.0 + 0.01 * i, np.float32)}, 1.0)
    rnd.add("x", {"w": np.full(4, 1e6, np.float32)}, 1.0)
    rnd.add("y", {"w": np.full(4, -1e6, np.float32)}, 1.0)
    assert np.all(np.abs(rnd.result()["w"] - 1.035) < 0.05)


def test_the_geometric_median_is_the_point_of_least_summed_distance_and_honours_weights():
    rng = np.random.default_rng(0)
    points = rng.standard_normal((7, 5))
    z = geometric_median(points, np.ones(7), iterations=200)
    cost = lambda p: np.linalg.norm(points - p, axis=1).sum()  # noqa: E731
    assert all(cost(z) <= cost(z + 1e-3 * rng.standard_normal(5)) for _ in range(50))
    heavy = geometric_median(np.array([[0.0], [1.0], [10.0]]), np.array([1.0, 3.0, 1.0]), iterations=200)
    assert heavy[0] == pytest.approx(1.0, abs=1e-4)  # the median of 0, 1, 1, 1, 10


def test_trimmed_mean_keeps_at_least_one_value():
    assert trimmed_mean(np.array([[1.0], [5.0]]), 0.49)[0] == 3.0
    assert trimmed_mean(np.array([[1.0], [2.0], [100.0]]), 0.4)[0] == 2.0


def test_settings_refuse_what_agents_refuse_and_unknown_aggregators():
    from broker_coordinator.settings.round_settings import RoundSettings
    with pytest.raises(ValueError, match="local_epochs must be a whole number 0-100"):
        RoundSettings(local_epochs=150).validate()
    with pytest.raises(ValueError, match="aggregator must be one of"):
        RoundSettings(aggregator="krum").validate()
    with pytest.raises(ValueError, match="norm_bound must be 0"):
        RoundSettings(norm_bound=0.5).validate()


def _checkpoint(round_no, value):
    from broker_coordinator.storage.store import Checkpoint, model_sha256
    weights = {"w": np.full(2, value, np.float32)}
    return Checkpoint(round_no, round_no, "digits_mlp", weights, model_sha256(weights), {}, {})


def test_rollback_goes_back_under_a_new_version_and_keeps_the_history(tmp_path):
    from broker_coordinator.storage.store import Store, StoreError
    store = Store(tmp_path, keep=3)
    for r in range(1, 6):
        store.save_checkpoint(_checkpoint(r, float(r)))
        store.record_round({"round": r, "attempt": 1, "closed": "complete", "selected": 2, "participants": 2,
                            "accuracy": 0.5, "loss": 1.0, "bytes_up": 10, "seconds": 1.0, "rejected": {}})
    assert store.kept_rounds() == [3, 4, 5]
    with pytest.raises(StoreError, match="kept rounds: 3, 4, 5"):
        store.rollback(1)
    ckpt = store.rollback(3)
    assert ckpt.round == 3 and ckpt.version == 6  # one past the newest version any device may hold
    live = Store(tmp_path).load_checkpoint()
    assert live.round == 3 and live.weights["w"][0] == 3.0
    rows = store.rounds()
    assert [r["closed"] for r in rows] == ["complete"] * 5 + ["rollback"]  # nothing deleted or replaced


def test_reading_the_checkpoint_beside_a_running_coordinator_never_records_its_round(tmp_path):
    """Before: load_checkpoint also wrote the round's row when it was missing, so a reader that
    looked between the coordinator's two writes (checkpoint, then database) recorded the round, and
    the coordinator recorded it again (seen under load in test_coordinator_sigkill_resumes_from_checkpoint)."""
    from broker_coordinator.storage.store import Store
    row = {"round": 1, "attempt": 1, "closed": "complete", "selected": 2, "participants": 2, "accuracy": 0.5,
           "loss": 1.0, "bytes_up": 10, "seconds": 1.0, "rejected": {}}
    coordinator = Store(tmp_path)
    ckpt = _checkpoint(1, 1.0)
    ckpt.record = {**row, "model_sha256": ckpt.sha256}
    coordinator.save_checkpoint(ckpt)
    reader = Store(tmp_path)  # `status`, a test polling for a round, the fault drill
    assert reader.load_checkpoint().round == 1 and reader.rounds() == []
    coordinator.record_round(ckpt.record)  # the coordinator's second write
    assert [r["round"] for r in reader.rounds()] == [1]
    # a crash between the two writes: the coordinator starting again (it holds the state lock) fills it in, once
    ckpt2 = _checkpoint(2, 2.0)
    ckpt2.record = {**row, "round": 2, "model_sha256": ckpt2.sha256}
    coordinator.save_checkpoint(ckpt2)
    restarted = Store(tmp_path)
    assert restarted.recover_checkpoint().round == 2 and restarted.recover_checkpoint().round == 2
    assert [r["round"] for r in restarted.rounds()] == [1, 2]


def test_attempts_are_never_overwritten_and_old_databases_migrate(tmp_path):
    from broker_coordinator.storage.store import Store
    db = sqlite3.connect(tmp_path / "coordinator.db")  # the schema before history became append-only
    db.execute("CREATE TABLE rounds (round INTEGER NOT NULL, attempt INTEGER NOT NULL, closed TEXT NOT NULL, "
               "selected INTEGER, participants INTEGER, accuracy REAL, loss REAL, bytes_up INTEGER, seconds REAL, "
               "rejected TEXT, base_sha256 TEXT, model_sha256 TEXT, finished_at REAL, PRIMARY KEY (round, attempt))")
    db.execute("INSERT INTO rounds VALUES (1, 1, 'abandoned', 2, 0, NULL, NULL, 0, 1.0, '{}', 'a', 'a', ?)",
               (time.time(),))
    db.commit()
    db.close()
    store = Store(tmp_path)
    assert store.last_attempt(1) == 1
    row = {"round": 1, "attempt": 1, "closed": "abandoned", "selected": 2, "participants": 0, "accuracy": None,
           "loss": None, "bytes_up": 0, "seconds": 1.0, "rejected": {}}
    store.record_round(row)  # the same (round, attempt) again is a new row, not a replacement
    assert len(store.rounds()) == 2


def test_the_gate_leaves_out_a_reversed_update_and_keeps_the_majority():
    rng = np.random.default_rng(0)
    common = rng.standard_normal(64).astype(np.float32)
    bound = NormBound(multiplier=0)
    rnd = RobustRound({"w": (64,)}, bound, "gated_mean")
    honest = [common + 0.8 * rng.standard_normal(64).astype(np.float32) for _ in range(7)]
    for i, d in enumerate(honest):
        rnd.add(f"h{i}", {"w": d}, 1.0)
    rnd.add("flip", {"w": -4 * honest[0]}, 1.0)
    mean = rnd.result()["w"]
    assert set(rnd.gated) == {"flip"} and rnd.gated["flip"] < 0
    assert np.allclose(mean, np.mean(honest, axis=0), atol=1e-5)


def test_a_root_reference_replaces_the_median():
    rng = np.random.default_rng(1)
    trusted = rng.standard_normal(16).astype(np.float32)
    rnd = RobustRound({"w": (16,)}, NormBound(multiplier=0), "gated_mean", reference=lambda names: trusted)
    for i in range(3):  # a majority that points away from what the trusted data says
        rnd.add(f"x{i}", {"w": -trusted}, 1.0)
    for i in range(2):
        rnd.add(f"h{i}", {"w": trusted}, 1.0)
    rnd.result()
    assert len(rnd.gated) == 2 and all(d.startswith("x") for d in rnd.gated)  # half the round (3) is kept


def test_root_reference_needs_root_data():
    from broker_coordinator.engine.loop import Engine
    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_models import datasets
    with pytest.raises(ValueError, match="root_data"):
        Engine("u", "digits_mlp", datasets.load("digits").test, RoundSettings(reference="root"))


def test_rollback_from_the_command_line_and_refused_while_the_coordinator_runs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from broker_coordinator.storage.statelock import StateLock
    from broker_coordinator.storage.store import Store
    from edgefl_protocol.settings import to_toml

    state = tmp_path / "state"
    store = Store(state)
    for r in (1, 2, 3):
        store.save_checkpoint(_checkpoint(r, float(r)))
    store.close()
    np.savez(tmp_path / "test.npz", x=np.zeros((2, 64), np.float32), y=np.zeros(2, np.int64))
    config = tmp_path / "coordinator.toml"
    config.write_text(to_toml({"pacing": {"interval": 0, "patience": 0}, "federation": {"name": "u", "model": "digits_mlp", "test_data": str(tmp_path / "test.npz")},
                               "broker": {"password": "x"}, "storage": {"state_dir": str(state)}}))
    root = Path(__file__).resolve().parent.parent

    def rollback(to: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "broker_coordinator", "rollback", "--config", str(config),
                               "--to", str(to)], capture_output=True, text=True, cwd=root, timeout=120)

    with StateLock(state).acquire("run"):  # as `broker-coordinator run` holds it
        refused = rollback(2)
    assert refused.returncode == 2 and "stop it first" in refused.stderr
    done = rollback(2)
    assert done.returncode == 0, done.stderr
    assert "rolled back from round 3 to round 2" in done.stdout and "version 4" in done.stdout
    assert Store(state).load_checkpoint().round == 2


def _round_with_one_attacker(n: int, attack: str, seed: int) -> float:
    """Distance of a centered_clip aggregate from the mean of its n - 1 honest updates."""
    rng = np.random.default_rng(seed)
    size = 64
    step = rng.standard_normal(size).astype(np.float32)
    step /= np.linalg.norm(step)  # the last applied step: the round's centre

    def honest_update():
        return (step + 0.1 * rng.standard_normal(size)).astype(np.float32)

    bound, radius = NormBound(1.5), NormBound(1.5)
    for i in range(20):  # earlier rounds' honest norms and distances from their centre
        h = honest_update()
        bound.record(float(np.linalg.norm(h)), f"old-{i}")
        radius.record(float(np.linalg.norm(h - step)), f"old-{i}")
    rnd = RobustRound({"w": (size,)}, bound, "centered_clip", center={"w": step}, radius=radius)
    honest = [honest_update() for _ in range(n - 1)]
    for i, h in enumerate(honest):
        rnd.add(f"h{i}", {"w": h}, 1.0)
    if attack == "reversed":  # the global step reversed, scaled to just under the norm bound
        bad = -0.99 * bound.bound() * step
    else:  # a random delta of norm 1e6
        bad = rng.standard_normal(size)
        bad *= 1e6 / np.linalg.norm(bad)
    rnd.add("attacker", {"w": bad.astype(np.float32)}, 1.0)
    assert "attacker" in rnd.centered
    return float(np.linalg.norm(rnd.result()["w"] - np.mean(honest, axis=0)))


@pytest.mark.parametrize("attack", ["reversed", "random"])
def test_a_round_of_4_is_defended_as_well_as_a_round_of_10(attack):
    """Issue 20: one attacker of 4 held a quarter of the round's weight, so it pulled the aggregate 2.6x
    as far from the honest mean as one of 10. The radius-clipped updates now share at most
    OUTLIER_SHARE of a round's weight."""
    four = np.mean([_round_with_one_attacker(4, attack, s) for s in range(20)])
    ten = np.mean([_round_with_one_attacker(10, attack, s) for s in range(20)])
    assert four <= 1.2 * ten, f"a round of 4 ends {four / ten:.2f}x as far from its honest mean as a round of 10"


def test_a_device_the_radius_keeps_clipping_fades_and_an_honest_outlier_recovers():
    center = {"w": np.full(4, 0.5, np.float32)}
    radius = NormBound(multiplier=1.5)
    for i in range(9):
        radius.record(0.2, f"h{i}")
    shares = []
    for round_no in range(4):
        rnd = RobustRound(SPECS, NormBound(multiplier=0), "centered_clip", center=center, radius=radius)
        for i in range(9):
            rnd.add(f"h{i}", {"w": np.full(4, 0.55, np.float32)}, 1.0)
        rnd.add("attacker", {"w": np.full(4, -0.5, np.float32)}, 1.0)  # distance 2.0, radius 0.3: 0.15 a round
        once = np.full(4, -0.5 if round_no == 0 else 0.55, np.float32)  # clipped in the first round only
        rnd.add("once", {"w": once}, 1.0)
        rnd.result()
        shares.append(rnd.discounted.get("attacker", (1.0, ""))[0])
    # the first update outside costs nothing later; the second its radius / distance (0.15 / 2.0: the honest
    # devices' distances, 0.1, set the radius from round 2 on), the third that again (below MIN_STANDING)
    assert shares == pytest.approx([1.0, 1.0, 0.075, 0.05])
    assert "once" not in radius.standing  # outside once: its device keeps its weight
    again = NormBound()
    again.load_state(radius.state())
    assert again.standing == radius.standing
