"""The private fold: user-level central differential privacy of each applied version
(DP-FedAvg, McMahan et al., ICLR 2018; adaptive clipping, Andrew et al., NeurIPS 2021).

Each decoded delta is clipped on the coordinator to the round's clip C (the uploads are what they
were), every clipped delta weighs 1, and the sum is divided by a fixed denominator m, the expected
cohort, not by the number that answered:

    aggregate = ( sum_k clip(delta_k, C) + N(0, (z_delta C)^2 I) ) / m,   clip(x, C) = x min(1, C / ||x||)

So adding or removing one device moves the sum by at most C, whoever else answered, and the
Gaussian noise (std z_delta C on the sum, z_delta C / m on the mean) is drawn once per applied
version from a generator seeded by the operating system's CSPRNG (`secrets`). Sample counts,
local steps and every other claim of a device are ignored: they would scale a contribution
beyond C.

Adaptive clipping (`clip = "adaptive"`): each update also contributes b_k = 1[||delta_k|| <= C]
and the coordinator releases the noisy fraction b~ = (sum_k (b_k - 1/2) + N(0, sigma_b^2)) / m + 1/2
(sensitivity 1/2); the next round's clip is C exp(-eta (b~ - gamma)), steering C to the gamma
quantile of the update norms. The two releases together are one Gaussian mechanism with noise
multiplier z, where 1/z^2 = 1/z_delta^2 + 1/(2 sigma_b)^2 (Andrew et al., Theorem 1): the
accountant counts z, and the update's own noise is z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2).

Parameters (`[privacy]`, broker_coordinator/settings/privacy_settings.py): `clip` ("adaptive" or
a fixed C), `clip_initial` (0.1), `target_quantile` gamma (0.5), `clip_learning_rate` eta (0.2),
`clip_count_stddev` sigma_b (0 = max(m / 20, z): m / 20 is the paper's choice, and at least z
keeps z_delta within 1.16 z at small cohorts).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker_coordinator.aggregation.fold import FoldReport
from broker_coordinator.aggregation.robust import l2_norm
from broker_coordinator.aggregation.streaming import StreamingMean


def update_noise(z: float, count_stddev: float) -> float:
    """z_delta: the update's noise multiplier when the clip count has noise sigma_b and the pair
    together is accounted as one Gaussian with multiplier z (inf: sigma_b too small for z)."""
    if count_stddev <= 0:
        return z
    rest = z ** -2 - (2 * count_stddev) ** -2
    return 1 / math.sqrt(rest) if rest > 0 else math.inf


def count_stddev(z: float, cohort: int, configured: float = 0.0) -> float:
    return configured if configured > 0 else max(cohort / 20.0, z)


def secure_generator() -> np.random.Generator:
    """A numpy generator seeded with 128 bits from the operating system's CSPRNG."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


def secure_uniforms(n: int) -> np.ndarray:
    """n independent uniforms in [0, 1), each 53 bits straight from the operating system's CSPRNG,
    as `secrets.SystemRandom().random()` draws one, but in one read of 8 n bytes: a Poisson cohort of
    10,000 eligible devices costs the coordinator about 1 ms instead of 25-30 ms of one system call
    per device (bench/privacy.py --round-time-only)."""
    raw = np.frombuffer(secrets.token_bytes(8 * n), dtype="<u8")
    return (raw >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


@dataclass
class AdaptiveClip:
    """The clip and its geometric update from the private unclipped fraction."""
    clip: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    adaptive: bool = True

    def update(self, unclipped_fraction: float) -> None:
        if self.adaptive:
            self.clip *= math.exp(-self.learning_rate * (unclipped_fraction - self.target_quantile))

    def state(self) -> dict[str, Any]:
        return {"clip": self.clip}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if self.adaptive and state.get("clip"):
            self.clip = float(state["clip"])


class PrivateRound:
    """One applied version's private fold (`fold.Fold`, taking device updates as `robust.RobustRound`
    does), with weights and steps ignored and the noise added in `result`."""

    def __init__(self, specs: Mapping[str, tuple[int, ...]], clip: float, z_delta: float, denominator: float,
                 count_noise: float | None = None) -> None:
        """`count_noise`: sigma_b of the adaptive clip's unclipped count (None: a fixed clip)."""
        if not (clip > 0 and denominator > 0 and z_delta >= 0):
            raise ValueError(f"clip {clip}, denominator {denominator} and noise {z_delta} must be positive")
        self.specs, self.clip, self.z_delta, self.denominator = dict(specs), clip, z_delta, denominator
        self.count_noise = count_noise
        self.sums = {name: np.zeros(shape, dtype=np.float64) for name, shape in self.specs.items()}
        self.count = 0
        self.unclipped = 0  # b_k summed: known to the coordinator only; released with noise
        self.clipped: dict[str, tuple[float, float]] = {}  # per device: never in the record (see records)
        self.gated: dict[str, float] = {}
        self.discounted: dict[str, tuple[float, str]] = {}  # the private mean weighs every update alike
        # RobustRound's other records, empty here: the private fold pulls nothing towards a centre and
        # holds nothing, so each device's verdict (its own clip scale) is decided at `add`
        self.centered: dict[str, tuple[float, float]] = {}
        self.released: dict[str, float] = {}  # what `result` released beside the model: noise std, b~
        self.votes = None  # the private fold casts no sign votes

    @property
    def center(self) -> None:
        return None

    def undecided(self, device: str) -> bool:
        return False  # each device's verdict (its own clip scale) is decided at `add`

    def report(self) -> FoldReport:
        """Which device was clipped is not released: the record gives the noisy unclipped fraction."""
        return FoldReport(self.count, released=dict(self.released), private=True)

    def add(self, device: str, delta: Mapping[str, np.ndarray], weight: float = 1.0, steps: int = 1,
            norm: float | None = None) -> None:
        norm = l2_norm({n: delta[n] for n in self.specs}) if norm is None else norm
        scale = min(1.0, self.clip / norm) if norm > 0 else 1.0
        if scale < 1.0:
            self.clipped[device] = (norm, self.clip)
        else:
            self.unclipped += 1
        for name, acc in self.sums.items():  # into the float64 sums without a float64 copy of the delta
            acc += delta[name] if scale == 1.0 else delta[name] * np.float32(scale)
        self.count += 1

    def merge(self, sums: Mapping[str, np.ndarray], count: int, unclipped: int) -> None:
        """Fold in a site's clipped sum of `count` deltas (`private_partials`): the sum is associative,
        so the centre holds what it would have summed itself, and `mean` adds the one noise draw."""
        for name, acc in self.sums.items():
            acc += np.asarray(sums[name], dtype=np.float64)
        self.count += count
        self.unclipped += unclipped

    def streamed(self) -> StreamingMean:
        """The clipped sum as a site's partial carries it: weight 1 and one step per delta."""
        stream = StreamingMean(self.specs)
        stream.merge(self.sums, float(self.count), float(self.count), self.count)
        return stream

    def clipped_sum(self) -> dict[str, np.ndarray]:
        """The pre-noise sum (tests check its sensitivity)."""
        return {name: acc.copy() for name, acc in self.sums.items()}

    def result(self, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
        """The noisy mean over the fixed denominator; call once per applied version."""
        if self.count == 0:
            raise ValueError("no updates were folded in")
        rng = rng or secure_generator()
        std = self.z_delta * self.clip
        out = {name: ((acc + rng.normal(0.0, std, acc.shape)) / self.denominator).astype(np.float32)
               for name, acc in self.sums.items()}
        self.released = {"noise_std": std / self.denominator, "clip": self.clip}
        if self.count_noise is not None:
            noisy = self.unclipped - self.count / 2 + rng.normal(0.0, self.count_noise)
            self.released["unclipped_fraction"] = float(noisy / self.denominator + 0.5)
        return out
