"""The privacy accountant: epsilon spent at delta by the applied versions so far, over Google's
dp-accounting (`pip install edgefl[privacy]`).

Each applied version is one sampled Gaussian mechanism on the sum of the cohort's clipped updates
(sensitivity C under adding or removing one device, noise std z C; see `privacy`):

- `sampling = "poisson"`: every device joins with probability q = m / N, independently, and the
  event is `PoissonSampledDpEvent(q, GaussianDpEvent(z))`, neighbours by adding or removing one
  device (the RDP bound of Mironov et al. 2019, or the PLD of Koskela / Doroshenko et al.).
- `sampling = "fixed"`: exactly m of the n eligible devices, uniformly. Sampling without
  replacement is only accounted for neighbours that *replace* one device (Wang, Balle and
  Kasiviswanathan, AISTATS 2019, dp-accounting's RDP accountant); swapping one device's update for
  another's moves the sum by up to 2C, so the event's noise multiplier is z / 2:
  `SampledWithoutReplacementDpEvent(n, m, GaussianDpEvent(z / 2))`. That is honest and much looser
  (for 1,000 of 10,000, z = 0.83, 40 rounds: epsilon 92 against Poisson's 7.9), which is why
  poisson is the default.

The `Ledger` is the spent budget: how many versions were applied under each (sampling, z). It is
checkpointed and only ever grows: loading an older state (a restart, a rollback) keeps the larger
count of each entry, so no epsilon is ever refunded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from broker_coordinator.settings.privacy_settings import MISSING

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter


@dataclass(frozen=True)
class Sampling:
    kind: str  # "poisson" | "fixed"
    population: int  # N (poisson) or n, the eligible devices the cohort was drawn from (fixed)
    cohort: int  # m: the expected (poisson) or exact (fixed) cohort, the fold's denominator

    @property
    def rate(self) -> float:
        return min(1.0, self.cohort / self.population)

    def key(self, z: float) -> str:
        return f"{self.kind}:{self.population}:{self.cohort}:{z!r}"

    @staticmethod
    def of_key(key: str) -> tuple[Sampling, float]:
        kind, population, cohort, z = key.split(":")
        return Sampling(kind, int(population), int(cohort)), float(z)


def _dp() -> Any:
    try:
        import dp_accounting
    except ImportError:
        raise RuntimeError(MISSING) from None
    return dp_accounting


def event(sampling: Sampling, z: float, versions: int = 1) -> Any:
    dp = _dp()
    e = dp.dp_event
    if sampling.kind == "fixed":
        inner = e.SampledWithoutReplacementDpEvent(sampling.population, min(sampling.cohort, sampling.population),
                                                   e.GaussianDpEvent(z / 2))
    elif sampling.rate >= 1.0:
        inner = e.GaussianDpEvent(z)
    else:
        inner = e.PoissonSampledDpEvent(sampling.rate, e.GaussianDpEvent(z))
    return e.SelfComposedDpEvent(inner, versions)


class Accountant:
    def __init__(self, kind: str = "rdp") -> None:
        if kind not in ("rdp", "pld"):
            raise ValueError(f"accountant must be rdp or pld, got {kind!r}")
        self.kind = kind
        self._rdp_of: dict[tuple[Sampling, float, str], tuple[Any, Any]] = {}  # one version's RDP curve, per event

    def fresh(self, relation: str = "add_remove") -> Any:
        dp = _dp()
        neighbours = (dp.NeighboringRelation.REPLACE_ONE if relation == "replace"
                      else dp.NeighboringRelation.ADD_OR_REMOVE_ONE)
        if self.kind == "pld":
            from dp_accounting.pld import pld_privacy_accountant
            return pld_privacy_accountant.PLDAccountant(neighbours)
        from dp_accounting.rdp import rdp_privacy_accountant
        return rdp_privacy_accountant.RdpAccountant(neighboring_relation=neighbours)

    def epsilon(self, spent: Iterable[tuple[Sampling, float, int]], delta: float) -> float:
        """Epsilon at delta of the composition of (sampling, z, versions) entries (0 for none)."""
        spent = [(s, z, n) for s, z, n in spent if n > 0]
        if not spent:
            return 0.0
        fixed = any(s.kind == "fixed" for s, _, _ in spent)
        if self.kind == "rdp":  # RDP composes by adding curves: one curve per event, then a cheap sum
            from dp_accounting.rdp import rdp_privacy_accountant
            curves = [(self._curve(sampling, z, "replace" if fixed else "add_remove"), n) for sampling, z, n in spent]
            orders = curves[0][0][0]
            total = sum(n * rdp for (_, rdp), n in curves)
            return float(rdp_privacy_accountant.compute_epsilon(orders, total, delta)[0])
        accountant = self.fresh("replace" if fixed else "add_remove")
        for sampling, z, versions in spent:
            accountant.compose(event(sampling, z, versions))
        return float(accountant.get_epsilon(delta))

    def _curve(self, sampling: Sampling, z: float, relation: str) -> tuple[Any, Any]:
        key = (sampling, z, relation)
        if key not in self._rdp_of:
            accountant = self.fresh(relation)
            accountant.compose(event(sampling, z, 1))
            # dp-accounting keeps the composed curve on the accountant (no public getter)
            self._rdp_of[key] = (accountant._orders.copy(), accountant._rdp.copy())
        return self._rdp_of[key]

    def noise_for(self, sampling: Sampling, rounds: int, target_epsilon: float, delta: float) -> float:
        """The smallest z whose `rounds` versions spend at most target_epsilon at delta."""
        dp = _dp()
        relation = "replace" if sampling.kind == "fixed" else "add_remove"
        bracket = dp.LowerEndpointAndGuess(1e-3, 1.0)
        if self.kind == "pld":
            # PLD discretises the privacy loss, and at z = 1e-3 that takes tens of GB (1,000 of 10,000,
            # 40 rounds: 38 GiB). RDP's z is an upper bound (RDP never reports less epsilon than PLD),
            # so the search stays between half of it and it, where PLD costs seconds.
            upper = Accountant("rdp").noise_for(sampling, rounds, target_epsilon, delta)
            bracket = dp.ExplicitBracketInterval(upper / 2, upper)
        try:
            return float(dp.calibrate_dp_mechanism(lambda: self.fresh(relation),
                                                   lambda z: event(sampling, z, rounds), target_epsilon, delta,
                                                   bracket, tol=1e-4))
        except Exception as exc:  # dp-accounting raises a bare ValueError when no bracket holds the target
            if self.kind == "pld":  # PLD needs less than half RDP's noise (not met so far): RDP's z still holds
                return upper
            raise ValueError(f"no noise multiplier reaches epsilon {target_epsilon:g} at delta {delta:g} in "
                             f"{rounds} rounds with {sampling.kind} sampling of {sampling.cohort} of "
                             f"{sampling.population}: {exc}") from None


class Ledger:
    """The spent budget: versions applied per (sampling, z), never decreasing."""

    def __init__(self, accountant: Accountant, delta: float) -> None:
        self.accountant, self.delta = accountant, delta
        self.versions: dict[str, int] = {}
        self._cache: dict[tuple, float] = {}

    def _entries(self, extra: str | None = None) -> list[tuple[Sampling, float, int]]:
        counts = dict(self.versions)
        if extra is not None:
            counts[extra] = counts.get(extra, 0) + 1
        return [(*Sampling.of_key(key), n) for key, n in sorted(counts.items())]

    def epsilon(self, after: tuple[Sampling, float] | None = None) -> float:
        """Spent epsilon at delta; with `after`, what it would be after one more version of it."""
        extra = after[0].key(after[1]) if after else None
        counts = dict(self.versions)
        if extra is not None:
            counts[extra] = counts.get(extra, 0) + 1
        cache_key = tuple(sorted(counts.items()))
        if cache_key not in self._cache:
            self._cache = {cache_key: self.accountant.epsilon(self._entries(extra), self.delta), **{
                k: v for k, v in list(self._cache.items())[-4:]}}
        return self._cache[cache_key]

    @property
    def applied(self) -> int:
        return sum(self.versions.values())

    def record(self, sampling: Sampling, z: float) -> None:
        key = sampling.key(z)
        self.versions[key] = self.versions.get(key, 0) + 1

    def state(self) -> dict[str, Any]:
        return {"versions": dict(self.versions), "delta": self.delta}

    def load_state(self, state: dict[str, Any]) -> None:
        """Merge a stored state: each entry keeps the larger count (a restart or a rollback never
        refunds epsilon)."""
        for key, n in (state.get("versions") or {}).items():
            self.versions[str(key)] = max(self.versions.get(str(key), 0), int(n))
