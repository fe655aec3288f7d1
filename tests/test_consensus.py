"""The standing a device earns from how its updates agree with their rounds (consensus.py) and
what centered_clip does with it (robust.py). Units: no broker needed."""

import numpy as np
import pytest

from broker_coordinator.aggregation.consensus import (
    CHUNK,
    COPY_FLAGS,
    FLAG_COST,
    KIN_MIN_ROUNDS,
    MIN_JUDGED,
    WINDOW,
    Consensus,
    Sketcher,
    disagreeing,
    median_cosines,
    noise,
)
from broker_coordinator.aggregation import consensus as consensus_module
from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.aggregation.trust import MIN_STANDING, NormBound

SIZE = 3000


@pytest.mark.parametrize("sparse", [False, True])
def test_sketches_keep_cosines(sparse):
    rng = np.random.default_rng(1)
    sketch = Sketcher({"a": (SIZE - 1000,), "b": (1000,)})
    for target in (-0.6, 0.0, 0.3, 0.9):
        x = rng.standard_normal(SIZE)
        y = target * x + np.sqrt(1 - target ** 2) * rng.standard_normal(SIZE)
        if sparse:  # what the top-k codec leaves: a tenth of the coordinates
            keep = rng.random(SIZE) < 0.1
            x, y = x * keep, y * keep
        true = x @ y / np.linalg.norm(x) / np.linalg.norm(y)
        sx, sy = (sketch({"a": v[:SIZE - 1000], "b": v[SIZE - 1000:]}) for v in (x, y))
        assert sx @ sy / np.linalg.norm(sx) / np.linalg.norm(sy) == pytest.approx(true, abs=0.08)


def _round(rng, honest: int, flipped: int, spread: float = 1.0) -> dict[str, np.ndarray]:
    """A shared task direction plus each device's own (non-IID) part; flipped devices send -3x theirs."""
    task = rng.standard_normal(SIZE)
    out = {f"h{i}": task + spread * rng.standard_normal(SIZE) for i in range(honest)}
    out |= {f"x{i}": -3 * (task + spread * rng.standard_normal(SIZE)) for i in range(flipped)}
    return out


def test_flipped_updates_are_flagged_and_honest_non_iid_ones_are_not():
    rng = np.random.default_rng(2)
    for _ in range(10):
        flagged = disagreeing(_round(rng, honest=8, flipped=2, spread=2.5))  # honest cosines about 0.14
        assert set(flagged) == {"x0", "x1"}
        assert disagreeing(_round(rng, honest=10, flipped=0, spread=2.5)) == {}
    assert disagreeing(_round(rng, honest=MIN_JUDGED - 2, flipped=1)) == {}  # no majority to speak of


def test_a_persistent_attacker_fades_and_an_honest_device_flagged_once_recovers():
    rng = np.random.default_rng(3)
    consensus = Consensus()
    for round_no in range(4):
        updates = _round(rng, honest=8, flipped=1)
        if round_no == 0:
            updates["h0"] = -updates["h0"]  # an honest device's odd round
        if round_no == 3:
            updates["x0"] = -updates["x0"] / 3  # the attacker lies low for a round: it gains nothing back
        consensus.judge(updates)
    assert consensus.of("x0") == MIN_STANDING  # 3 flags of 4: 1 - 2 x 3/5 is below the floor
    assert consensus.of("h0") == pytest.approx(1 - FLAG_COST / WINDOW)
    for _ in range(WINDOW - 3):
        consensus.judge(_round(rng, honest=8, flipped=0))
    assert consensus.of("h0") == 1.0 and "h0" not in consensus.flags  # its flag left the window
    again = Consensus()
    again.load_state(consensus.state())
    assert again.flags == consensus.flags
    assert all(again.of(d) == consensus.of(d) for d in consensus.flags)


def test_centered_clip_weighs_a_device_by_its_standing_from_the_next_round_on():
    rng = np.random.default_rng(4)
    specs = {"w": (SIZE,)}
    consensus, bound = Consensus(), NormBound(multiplier=0)
    wide = NormBound(multiplier=1000)  # a radius that clips nothing: the weights alone decide
    means = []
    for _ in range(2):
        rnd = RobustRound(specs, bound, "centered_clip", consensus=consensus, radius=wide)
        updates = _round(rng, honest=8, flipped=2)
        for device, delta in updates.items():
            rnd.add(device, {"w": delta.astype(np.float32)}, 1.0)
        means.append((rnd.result()["w"], updates))
        assert set(rnd.disagreeing) == {"x0", "x1"}
    first, second = means
    # round 1: all ten at full weight; round 2: the two flagged ones at 1 - 2/5 of theirs
    assert np.allclose(first[0], np.mean(list(first[1].values()), axis=0), atol=1e-4)
    weights = {d: 1 - FLAG_COST / WINDOW if d.startswith("x") else 1.0 for d in second[1]}
    expected = sum(weights[d] * v for d, v in second[1].items()) / sum(weights.values())
    assert np.allclose(second[0], expected, atol=1e-4)
    assert RobustRound(specs, bound, "mean").consensus is None  # the plain mean stays plain


def test_a_restarted_coordinator_remembers_which_devices_disagreed(tmp_path):
    """The standing is trust state: a restart must not give a flagged attacker its weight back."""
    from broker_coordinator.engine.loop import Engine
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.storage.store import Checkpoint, Store, model_sha256
    from edgefl_models import datasets

    test = datasets.load("digits").test
    first = Engine("u", "digits_mlp", test, RoundSettings(), store=Store(tmp_path))
    first.consensus.flags = {"attacker": [1, 1, 0]}
    trust = first.trust_state()
    first.store.save_checkpoint(Checkpoint(3, 3, "digits_mlp", first.weights, model_sha256(first.weights), {}, {},
                                           trust=trust))
    again = Engine("u", "digits_mlp", test, RoundSettings(), store=Store(tmp_path))
    assert again.consensus.flags == {"attacker": [1, 1, 0]}
    assert again.consensus.of("attacker") == pytest.approx(1 - 2 * FLAG_COST / WINDOW)


def test_median_cosines_in_chunks_match_the_whole_matrix_across_chunk_boundaries():
    rng = np.random.default_rng(3)
    sketches = rng.standard_normal((2 * CHUNK + 44, 512)).astype(np.float32)
    sketches[: CHUNK + 10] += 0.5 * sketches[0]  # a majority that agrees, across the first boundary
    unit = sketches / np.linalg.norm(sketches.astype(np.float64), axis=1, keepdims=True)
    whole = unit @ unit.T
    np.fill_diagonal(whole, np.nan)
    np.testing.assert_allclose(median_cosines(sketches), np.nanmedian(whole, axis=1), atol=1e-6)


def _kin_round(rng, own: np.ndarray, goal: np.ndarray, accomplices: int) -> dict[str, np.ndarray]:
    """Non-IID honest devices: the task, each device's own lasting direction (its data) and noise.
    Accomplices look like honest devices but all add one hidden goal (a backdoor, a shared label flip)."""
    task = rng.standard_normal(SIZE)
    out = {f"h{i}": task + 1.5 * own[i] + 2 * rng.standard_normal(SIZE) for i in range(len(own))}
    out |= {f"k{i}": task + 1.5 * goal + 2 * rng.standard_normal(SIZE) for i in range(accomplices)}
    return out


def test_accomplices_are_kin_from_their_third_judged_update_and_honest_non_iid_devices_are_not():
    rng = np.random.default_rng(5)
    own, goal = rng.standard_normal((8, SIZE)), rng.standard_normal(SIZE)
    consensus = Consensus(kinship=0.4)
    for round_no in range(1, 9):
        updates = _kin_round(rng, own, goal, accomplices=2)
        assert disagreeing(updates) == {}  # the round's median sees nothing wrong with them
        consensus.judge(updates)
        assert set(consensus.kin) == (set() if round_no < KIN_MIN_ROUNDS else {"k0", "k1"})
    assert consensus.kin["k0"][0] == "k1"
    assert consensus.of("k0") == MIN_STANDING and consensus.of("h0") == 1.0


def test_kinship_zero_turns_the_flag_off_and_a_lone_attacker_has_no_kin():
    rng = np.random.default_rng(6)
    own, goal = rng.standard_normal((8, SIZE)), rng.standard_normal(SIZE)
    off, lone = Consensus(kinship=0.0), Consensus(kinship=0.4)
    for _ in range(6):
        off.judge(_kin_round(rng, own, goal, accomplices=2))
        lone.judge(_kin_round(rng, own, goal, accomplices=1))
        assert off.kin == {} and off.flags == {}
        assert lone.kin == {}


def test_paths_survive_a_checkpoint_and_the_least_recently_judged_are_forgotten(monkeypatch):
    from edgefl_protocol.persist import pack, unpack

    monkeypatch.setattr(consensus_module, "MAX_PATHS", 9)
    rng = np.random.default_rng(7)
    own, goal = rng.standard_normal((8, SIZE)), rng.standard_normal(SIZE)
    consensus = Consensus(kinship=0.4)
    for _ in range(KIN_MIN_ROUNDS):
        consensus.judge(_kin_round(rng, own, goal, accomplices=2))
    assert len(consensus.paths) == 9 and "h0" not in consensus.paths  # judged first in its round: forgotten
    again = Consensus(kinship=0.4)
    again.load_state(unpack(pack(consensus.state())))
    assert list(again.judged) == list(consensus.judged)
    for device, path in consensus.paths.items():
        np.testing.assert_allclose(again.paths[device], path, rtol=1e-2, atol=1e-2)
    update = _kin_round(rng, own, goal, accomplices=2)
    consensus.judge(update)
    again.judge(update)
    assert set(again.kin) == set(consensus.kin)


def test_agreement_floor_spares_updates_just_below_zero_and_still_flags_a_flipped_one():
    """A margin below 0: median cosines a hair below 0 are flagged by the default rule and spared by a
    floor; a flipped update, far below, is flagged either way."""
    rng = np.random.default_rng(8)
    task = rng.standard_normal(64)
    sketches = {f"honest-{i}": task + 1.5 * rng.standard_normal(64) for i in range(6)}  # a majority: cosines ~0.3
    sketches["odd"] = rng.standard_normal(64)  # its own data: a median cosine just below 0
    sketches["flipped"] = -3 * task
    odd = median_cosines(np.stack(list(sketches.values())))[6]
    assert -0.05 < odd < 0
    assert {"odd", "flipped"} <= set(disagreeing(sketches, floor=0.0, dimension=64))
    spared = disagreeing(sketches, floor=0.05, dimension=64)
    assert "odd" not in spared and "flipped" in spared


def test_a_round_without_a_majority_is_not_judged_and_leaves_no_mark():
    """Where devices' data share too little (FedProx's Synthetic), a round's median cosine sits within the
    noise of unrelated updates, 1/sqrt(dimension), and which way an update points says nothing: judging
    such rounds flagged 9-12% of honest updates in bench/attacks.py. They are not judged."""
    rng = np.random.default_rng(9)
    sketches = {f"d{i}": rng.standard_normal(610) for i in range(10)}  # unrelated: median cosines ~0 +- 0.04
    sketches["d0"] = -sketches["d1"] - sketches["d2"]  # pointing away from two of them
    assert noise(610) == pytest.approx(1 / np.sqrt(610))
    assert disagreeing(sketches, dimension=610) == {}
    consensus = Consensus()
    assert consensus.judge(sketches) == {} and consensus.flags == {}


def test_with_agreement_flags_2_a_first_flag_costs_nothing_and_a_second_does():
    rng = np.random.default_rng(5)
    consensus = Consensus(flags_to_act=2)
    consensus.judge(_round(rng, honest=8, flipped=1))
    assert consensus.flags["x0"] == [1] and consensus.of("x0") == 1.0  # remembered, not yet acted on
    consensus.judge(_round(rng, honest=8, flipped=1))
    assert consensus.of("x0") == pytest.approx(1 - 2 * FLAG_COST / WINDOW)


def test_a_flagged_copy_of_another_update_counts_twice_and_survives_a_checkpoint():
    """Sybils sending one crafted update: each copy is flagged as two, so even with agreement_flags = 2 they
    lose weight from their first round; an honest update is never a copy."""
    rng = np.random.default_rng(6)
    consensus = Consensus(flags_to_act=2)
    updates = _round(rng, honest=8, flipped=1)
    updates["x1"] = updates["x0"].copy()
    flagged = consensus.judge(updates)
    assert {"x0", "x1"} <= set(flagged)
    assert consensus.flags["x0"] == [COPY_FLAGS] and consensus.flags["x1"] == [COPY_FLAGS]
    assert consensus.of("x0") == pytest.approx(1 - COPY_FLAGS * FLAG_COST / WINDOW)
    assert all(not any(consensus.flags.get(d, ())) for d in updates if d.startswith("h"))
    again = Consensus(flags_to_act=2)
    again.load_state(consensus.state())
    assert again.flags == consensus.flags and again.of("x1") == consensus.of("x1")
