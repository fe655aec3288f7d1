"""The private round's Poisson cohort: each eligible device joins with probability q, decided by
its own 53-bit uniform from the operating system's CSPRNG, all of a round's uniforms read at once
(engine/private_rounds.py, aggregation/privacy.py `secure_uniforms`)."""

import random

import numpy as np
import pytest

pytest.importorskip("dp_accounting")

from broker_coordinator.aggregation import privacy
from broker_coordinator.engine.private_rounds import PrivateRounds
from broker_coordinator.settings.privacy_settings import PrivacySettings


def test_secure_uniforms_take_53_bits_of_each_8_bytes(monkeypatch):
    blocks = [b"\x00" * 8, b"\xff" * 8, (1 << 11).to_bytes(8, "little"), ((1 << 11) - 1).to_bytes(8, "little")]
    monkeypatch.setattr(privacy.secrets, "token_bytes", lambda n: b"".join(blocks)[:n])
    u = privacy.secure_uniforms(4)
    assert u.dtype == np.float64
    assert list(u) == [0.0, 1 - 2.0 ** -53, 2.0 ** -53, 0.0]  # the top 53 bits; the low 11 dropped


def test_poisson_cohort_is_one_csprng_read_of_a_uniform_per_eligible_device(monkeypatch):
    reads = []
    real = privacy.secrets.token_bytes

    def counted(n):
        reads.append(n)
        return real(n)

    monkeypatch.setattr(privacy.secrets, "token_bytes", counted)
    rounds = PrivateRounds(PrivacySettings(mode="central", noise_multiplier=1.0, population=10_000), 10_000, 1_000)
    eligible = [f"dev-{i:05d}" for i in range(10_000)]
    seeded = random.getstate()
    sizes = []
    for _ in range(5):
        cohort = rounds.cohort(reversed(eligible[:9_000]))  # 1,000 offline: probability 0
        assert cohort <= set(eligible[:9_000])
        sizes.append(len(cohort))
    assert reads == [8 * 9_000] * 5  # one read per round, 8 bytes per eligible device
    assert random.getstate() == seeded  # never the seeded generator
    assert all(758 < n < 1042 for n in sizes)  # q = 0.1 of 9,000: mean 900, sd 28.5; within 5 sd


def test_poisson_cohort_of_one_device_joins_at_rate_q():
    rounds = PrivateRounds(PrivacySettings(mode="central", noise_multiplier=1.0, population=10_000), 10_000, 2_500)
    joined = sum(len(rounds.cohort(["dev-0"])) for _ in range(4_000))
    assert abs(joined / 4_000 - 0.25) < 5 * (0.25 * 0.75 / 4_000) ** 0.5
