"""The first and the small rounds are defended (aggregation/robust.py, trust.py): a first round
without a last step to centre on is centred on its first updates' median, and a round of 3 or 4
has the radius its devices' earlier distances give. Units: no broker needed."""

from __future__ import annotations

import numpy as np
import pytest

from broker_coordinator.aggregation.robust import OUTLIER_SHARE, RobustRound
from broker_coordinator.aggregation.trust import RADIUS_WARMUP, NormBound

SIZE = 400
SPECS = {"w": (SIZE,)}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _first_round(aggregator: str, seed: int) -> tuple[RobustRound, np.ndarray, np.ndarray]:
    """Seven honest non-IID updates and three sign-flipped ones (-3x), the flipped among the first five."""
    rng = np.random.default_rng(seed)
    task = rng.standard_normal(SIZE)
    honest = [task + rng.standard_normal(SIZE) for _ in range(7)]
    flipped = [-3 * (task + rng.standard_normal(SIZE)) for _ in range(3)]
    order = [("h0", honest[0]), ("x0", flipped[0]), ("h1", honest[1]), ("x1", flipped[1]), ("h2", honest[2]),
             ("x2", flipped[2])] + [(f"h{i}", honest[i]) for i in range(3, 7)]
    rnd = RobustRound(SPECS, NormBound(multiplier=1.5), aggregator)
    for device, delta in order:
        rnd.add(device, {"w": delta.astype(np.float32)}, 1.0)
    return rnd, rnd.result()["w"], np.mean(honest, axis=0)


@pytest.mark.parametrize("seed", range(5))
def test_a_first_round_is_centred_on_its_first_updates_median(seed):
    """Round 1 has no last step: before, it was the clipped mean, which three flipped updates of ten
    turned around; now the first five updates' coordinate-wise median is its centre, the flipped ones
    lie outside the radius and share at most OUTLIER_SHARE of the round's weight."""
    rnd, centred, honest = _first_round("centered_clip", seed)
    _, plain, _ = _first_round("mean", seed)
    assert rnd.provisional and set(rnd.centered) >= {"x0", "x1", "x2"}
    assert rnd.outlier_scale is not None and rnd.outlier_scale < 1
    assert _cosine(centred, honest) > 0.95
    # what the first round was: the clipped mean, pulled three times as far from the honest mean at least
    assert np.linalg.norm(plain - honest) > 3 * np.linalg.norm(centred - honest)


def test_a_first_round_of_two_has_no_median_to_speak_of():
    rnd = RobustRound(SPECS, NormBound(multiplier=1.5), "centered_clip")
    for device in ("a", "b"):
        rnd.add(device, {"w": np.ones(SIZE, np.float32)}, 1.0)
    np.testing.assert_allclose(rnd.result()["w"], 1.0)
    assert not rnd.provisional and rnd.center is None


def test_a_round_of_three_is_defended_by_the_radius_its_devices_gave_before():
    """The radius needs RADIUS_WARMUP devices' distances, carried over rounds: a federation of three
    devices has it from its second round, so a reversed step is clipped towards the centre."""
    assert RADIUS_WARMUP == 3
    rng = np.random.default_rng(1)
    center = {"w": rng.standard_normal(SIZE).astype(np.float32)}
    radius = NormBound.radius(1.5)
    for device in ("a", "b", "c"):  # round 1: three honest distances from the centre
        radius.observe(float(np.linalg.norm(rng.standard_normal(SIZE))), device, None)
    rnd = RobustRound(SPECS, NormBound(multiplier=0), "centered_clip", center=center, radius=radius)
    assert rnd.tau is not None
    honest = [center["w"] + rng.standard_normal(SIZE).astype(np.float32) for _ in range(2)]
    for device, delta in zip(("a", "b"), honest):
        rnd.add(device, {"w": delta}, 1.0)
    rnd.add("c", {"w": -5 * center["w"]}, 1.0)  # the last step reversed, five times over
    step = rnd.result()["w"]
    assert "c" in rnd.centered
    reversed_pull = np.linalg.norm(step - np.mean(honest, axis=0))
    assert reversed_pull < 2 * OUTLIER_SHARE * np.linalg.norm(center["w"]) * 6


def test_an_update_outside_the_radius_once_costs_its_device_nothing_later_and_again_does():
    radius = NormBound.radius(1.5)
    radius.stand("d", 0.5)
    assert "d" not in radius.standing  # one update outside: its data can do that
    radius.stand("d", 0.5)
    assert radius.standing["d"] == pytest.approx(0.5)
    radius.stand("d", 1.0)  # inside again: doubled back
    assert "d" not in radius.standing
    again = NormBound.radius(1.5)
    again.load_state(radius.state())
    assert again.strikes == radius.strikes and again.strikes["d"] == [1, 1, 0]


def test_a_device_whose_updates_are_far_longer_than_the_bound_again_loses_standing():
    """An update over LENGTH_STRIKE x the norm bound is a strike: honest updates reached 2.4x at the
    99th percentile in bench/attacks.py, sign flips 3-60x. The first costs its device nothing later;
    from the second, bound / norm (as the radius' strikes); an honest device long once keeps its weight."""
    from broker_coordinator.aggregation.consensus import Consensus
    from broker_coordinator.aggregation.robust import LENGTH_STRIKE, LONG

    rng = np.random.default_rng(2)
    bound, radius, consensus = NormBound(multiplier=1.5), NormBound.radius(1000), Consensus()
    shares = {"long": [], "once": []}
    for round_no in range(4):
        rnd = RobustRound(SPECS, bound, "centered_clip", center={"w": np.zeros(SIZE, np.float32)}, radius=radius,
                          consensus=consensus)
        for i in range(8):
            rnd.add(f"h{i}", {"w": rng.standard_normal(SIZE).astype(np.float32)}, 1.0)
        far = 10 * rng.standard_normal(SIZE).astype(np.float32)  # about 7x the bound of 1.5x the median
        rnd.add("long", {"w": far}, 1.0)
        rnd.add("once", {"w": far if round_no == 0 else rng.standard_normal(SIZE).astype(np.float32)}, 1.0)
        rnd.result()
        for device in shares:
            shares[device].append(rnd.discounted.get(device, (1.0, ""))[0])
        if round_no == 2:
            assert LONG in rnd.discounted["long"][1]
    assert 10 / 1.5 > LENGTH_STRIKE
    assert shares["long"][:2] == [1.0, 1.0] and shares["long"][2] < 0.2 and shares["long"][3] == pytest.approx(0.05)
    assert shares["once"] == [1.0] * 4
