"""verdict_banks (aggregation/banks.py): the round's flags reach its own updates in a streaming fold.
Units: no broker needed (the engine path is in tests/test_kinship_engine.py's style below)."""

from __future__ import annotations

import numpy as np
import pytest

from broker_coordinator.aggregation.banks import VerdictBanks
from broker_coordinator.aggregation.consensus import Consensus
from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import MIN_STANDING, NormBound
from broker_coordinator.settings.round_settings import RoundSettings

SPECS = {"w": (64,)}


def _round(rng, flipped: int, honest: int = 9) -> dict[str, dict[str, np.ndarray]]:
    task = rng.standard_normal(64)
    out = {f"h{i}": {"w": (task + 0.5 * rng.standard_normal(64)).astype(np.float32)} for i in range(honest)}
    out |= {f"a{i}": {"w": (-3 * task).astype(np.float32)} for i in range(flipped)}
    return out


def _fold(updates: dict, banks: int, key: bytes = b"k" * 16) -> tuple[RobustRound, dict[str, np.ndarray]]:
    # a radius that clips nothing: the first round's provisional centre would put the flipped update
    # among the radius' outliers (at most 5% of the round), before the banks could hold it back
    rnd = RobustRound(SPECS, NormBound(multiplier=0), "centered_clip", consensus=Consensus(), verdict_banks=banks,
                      radius=NormBound(multiplier=1000))
    if rnd.banks is not None:
        rnd.banks.key = key
    for device, delta in updates.items():
        rnd.add(device, delta, 1.0)
    return rnd, rnd.result()


def test_a_flagged_update_is_held_back_in_its_own_round_and_its_bank_mates_with_it():
    rng = np.random.default_rng(1)
    updates = _round(rng, flipped=1)
    plain, plain_mean = _fold(updates, banks=0)
    banked, banked_mean = _fold(updates, banks=8)
    assert set(plain.disagreeing) == {"a0"} and plain.held_back == {}  # flagged, but folded in full
    assert "a0" in banked.held_back and set(banked.held_back.values()) == {MIN_STANDING}
    honest = np.mean([u["w"] for d, u in updates.items() if d != "a0"], axis=0)
    assert np.linalg.norm(banked_mean["w"] - honest) < 0.5 * np.linalg.norm(plain_mean["w"] - honest)
    # what the banks kept: the honest updates outside a0's bank in full, a0's bank at MIN_STANDING
    keep = {d: (MIN_STANDING if d in banked.held_back else 1.0) for d in updates}
    expected = sum(keep[d] * updates[d]["w"].astype(np.float64) for d in updates) / sum(keep.values())
    np.testing.assert_allclose(banked_mean["w"], expected, rtol=1e-5, atol=1e-6)


def test_without_a_flag_the_banks_give_the_plain_fold_in_any_order():
    rng = np.random.default_rng(2)
    updates = _round(rng, flipped=0)
    _, plain = _fold(updates, banks=0)
    _, banked = _fold(updates, banks=8)
    _, reversed_order = _fold(dict(reversed(list(updates.items()))), banks=8)
    np.testing.assert_allclose(banked["w"], plain["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(reversed_order["w"], plain["w"], rtol=1e-6, atol=1e-7)


def test_every_bank_flagged_cancels_out_and_the_bank_of_a_device_depends_on_the_round_s_key():
    out = StreamingMean(SPECS)
    banks = VerdictBanks(SPECS, 2, key=b"a" * 16)
    for i in range(6):
        banks.add(f"d{i}", {"w": np.full(64, float(i), np.float32)}, 1.0)
    flagged = {next(d for d in (f"d{i}" for i in range(6)) if banks.bank_of(d) == b) for b in range(2)}
    banks.settle(out, flagged)
    np.testing.assert_allclose(out.mean()["w"], np.full(64, 2.5), rtol=1e-6)  # the same scale everywhere
    a, b = VerdictBanks(SPECS, 8), VerdictBanks(SPECS, 8)  # keys from the operating system
    devices = [f"dev-{i}" for i in range(40)]
    assert [a.bank_of(d) for d in devices] != [b.bank_of(d) for d in devices]


def test_a_bank_count_outside_0_to_64_is_refused_with_the_range():
    with pytest.raises(ValueError, match="verdict_banks must be an integer from 0"):
        RoundSettings(verdict_banks=100).validate()
