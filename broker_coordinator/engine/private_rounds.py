"""`[privacy] mode = "central"` in the round loop: who is sampled, the private fold of each round,
the budget stop, and the spent epsilon that every record, the checkpoint, `status` and Prometheus
show (docs/PRIVACY.md). The coordinator holds one `PrivateRounds` and calls it at four places:
choosing the cohort, opening the round (`fold`; `check_budget` first), applying the version
(`applied`) and writing the checkpoint (`state`). In sites (`tree`) the cohort is drawn at the
sites, so it gives the site tasks their rules and quotas (`site_privacy`, `site_shares`) and the
round its aggregate of clipped partials (`tree_fold`); the rest is the same.

Choices the accounting rests on:
- the cohort is drawn with the operating system's CSPRNG (poisson: one 53-bit uniform per eligible
  device, all read at once, `privacy.secure_uniforms`; fixed: `secrets.SystemRandom`), never the
  coordinator's seeded `random.Random`, whose seed is in its config;
- poisson: each eligible device joins with probability q = m / N; a device that is offline has
  probability 0, which only helps it; the fold still divides by m;
- fixed: exactly m of the n eligible devices, accounted with that round's n (fewer devices online
  spend more epsilon, and the ledger says so);
- only applied versions spend budget: an abandoned attempt releases nothing.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from broker_coordinator.aggregation.accountant import Accountant, Ledger, Sampling
from broker_coordinator.aggregation.fold import FoldReport
from broker_coordinator.aggregation.privacy import (
    AdaptiveClip,
    PrivateRound,
    count_stddev,
    secure_uniforms,
    update_noise,
)
from broker_coordinator.aggregation.private_partials import PrivateTreeSum, SitePrivacy
from broker_coordinator.engine.rounds import RoundFailed
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_protocol import codec

log = logging.getLogger("broker_coordinator")


def uplink_advice(codec_name: str) -> str:
    """The warning for a top-k uplink under central DP ("" for a dense codec). The measurement is in
    bench/results/privacy.json; the likely reason, not isolated by a run: a top-k update keeps
    a tenth of a delta and owes the rest to the device's next update (error feedback); with one
    device in ten sampled per round that residual is many rounds stale when it arrives, it spends
    the clip on old directions, and the noise, sized to the clip, does not shrink with it. A dense
    update is clipped whole (docs/PRIVACY.md, "Which uplink")."""
    topk = codec.parse(codec_name).topk
    if not 0 < topk < 1:
        return ""
    return (f"privacy: the uplink codec {codec_name!r} sends top-k updates with error feedback; under central "
            f"DP that loses accuracy at the same epsilon (docs/PRIVACY.md, \"Which uplink\"): codec = \"float32\" "
            f"clips each update whole and cost less there, at many times the upload bytes")


class BudgetSpent(RoundFailed):
    """The next version would spend more than target_epsilon: no round is opened."""


class PrivateRounds:
    def __init__(self, settings: PrivacySettings, population: int, clients_per_round: int,
                 buffer_size: int = 0) -> None:
        """`buffer_size` K > 0: buffered mode. Who lands in a buffer depends on arrival times, not on
        a sampling the accountant can model, so each version is accounted as a release in which
        every device may take part (rate 1, no amplification by sampling); the fold divides by K,
        and a device lands at most once in a buffer (`buffered.BufferedVersions`), so one device still
        moves the pre-noise sum by at most C."""
        if population < 1:
            raise ValueError("[privacy] needs the number of devices a cohort is drawn from: set [privacy] "
                             "population = N (no enrolled devices are known yet)")
        settings.check_population(population)
        self.settings, self.population = settings, population
        self.cohort_size = min(clients_per_round or population, population)  # m, the fold's denominator
        self.accountant = Accountant(settings.accountant)
        self.ledger = Ledger(self.accountant, settings.delta)
        planned = Sampling(settings.sampling, population, self.cohort_size)
        if buffer_size:
            if settings.sampling != "poisson":
                raise ValueError('[privacy] sampling = "fixed" describes a drawn cohort; buffered mode draws '
                                 'none (each version is accounted at rate 1): set sampling = "poisson"')
            self.cohort_size = buffer_size
            planned = Sampling("poisson", population, population)  # rate 1: every device, every version
        self.z = settings.noise_multiplier or self.accountant.noise_for(
            planned, settings.planned_rounds, settings.target_epsilon, settings.delta)
        self.count_stddev = count_stddev(self.z, self.cohort_size, settings.clip_count_stddev) \
            if settings.adaptive else 0.0
        self.z_delta = update_noise(self.z, self.count_stddev)
        if self.z_delta == float("inf"):
            raise ValueError(f"clip_count_stddev = {self.count_stddev:g} is too small for z = {self.z:.3g}: "
                             f"the clip count alone would spend the budget; set it above {self.z / 2:.3g} or 0")
        self.clip = AdaptiveClip(settings.clip_initial if settings.adaptive else float(settings.clip),
                                 settings.target_quantile, settings.clip_learning_rate, settings.adaptive)
        self.sampling = planned  # this round's (fixed: n is counted when the cohort is drawn)
        self.random = secrets.SystemRandom()
        self.last: dict[str, float] = {}  # the last applied version's releases (noise std, clip, b~)
        self.stopped = ""
        self.ledger.epsilon((self.sampling, self.z))  # the accountant's curve, computed before any round opens
        log.info("privacy: %s sampling of %d of %d devices, z = %.4g (update noise %.4g), delta %g, %s clip, "
                 "%s accountant%s", settings.sampling, self.cohort_size, population, self.z, self.z_delta,
                 settings.delta, "adaptive" if settings.adaptive else f"fixed {settings.clip:g}",
                 settings.accountant, f", budget epsilon {settings.target_epsilon:g}"
                 if settings.target_epsilon else "")

    # the round loop's four calls -------------------------------------------------------
    def cohort(self, eligible: Sequence[str]) -> set[str]:
        eligible = sorted(eligible)
        if self.settings.sampling == "fixed":
            self.sampling = Sampling("fixed", max(len(eligible), 1), min(self.cohort_size, max(len(eligible), 1)))
            return set(self.random.sample(eligible, min(self.cohort_size, len(eligible))))
        q = self.cohort_size / self.population
        return {eligible[i] for i in np.flatnonzero(secure_uniforms(len(eligible)) < q)}

    def check_budget(self, round_no: int) -> None:
        target = self.settings.target_epsilon
        if not target:
            return
        after = self.ledger.epsilon((self.sampling, self.z))
        if after > target:
            self.stopped = (f"privacy budget spent: round {round_no} would bring epsilon from "
                            f"{self.spent:.3f} to {after:.3f} at delta {self.settings.delta:g}, above "
                            f"target_epsilon {target:g}; no further round is opened")
            log.error("%s", self.stopped)
            raise BudgetSpent(self.stopped)

    def fold(self, specs: dict[str, tuple[int, ...]]) -> PrivateRound:
        return PrivateRound(specs, self.clip.clip, self.z_delta, self.cohort_size,
                            self.count_stddev if self.settings.adaptive else None)

    def applied(self, report: FoldReport) -> None:
        """After the noisy mean was taken: spend the version's budget and move the clip."""
        self.ledger.record(self.sampling, self.z)
        self.last = dict(report.released)
        if "unclipped_fraction" in report.released:
            self.clip.update(report.released["unclipped_fraction"])

    # in sites (aggregation/private_partials.py): the sites draw and clip, the centre adds the noise
    def site_privacy(self) -> SitePrivacy:
        return SitePrivacy(self.clip.clip, self.settings.sampling, self.cohort_size / self.population)

    def site_shares(self, quotas: Mapping[str, int], eligible: Mapping[str, int]) -> dict[str, int]:
        """The sites to task and their quotas. poisson: every site with an eligible device (its leader
        draws each with q; the quota is only the quorum's guess). fixed: the centre's quotas, each
        site sampling k_s of its n_s without replacement; the cohort is stratified, so the round is
        accounted at the largest k_s / n_s of the tasked sites (for one device, the sampling of its
        own site is what matters), on the eligible counts the sites last reported."""
        if self.settings.sampling == "poisson":
            return {site: n for site, n in eligible.items() if n > 0}
        drawn = {site: (min(k or eligible.get(site, 0), eligible.get(site, 0)), eligible.get(site, 0))
                 for site, k in quotas.items() if eligible.get(site, 0) > 0}
        if drawn:
            k, n = max(drawn.values(), key=lambda kn: (kn[0] / kn[1], -kn[1]))
            self.sampling = Sampling("fixed", n, max(k, 1))
        return {site: k for site, k in quotas.items() if site in drawn}

    def tree_fold(self, specs: dict[str, tuple[int, ...]]) -> PrivateTreeSum:
        return PrivateTreeSum(self.fold(specs))

    # what people see ---------------------------------------------------------------
    @property
    def spent(self) -> float:
        return self.ledger.epsilon()

    def summary(self) -> dict[str, Any]:
        """The record's `privacy`: spent epsilon at delta and this version's releases."""
        out = {"epsilon": round(self.spent, 6), "delta": self.settings.delta, "noise_multiplier": self.z,
               "update_noise_multiplier": self.z_delta, "sampling": self.settings.sampling,
               "cohort": self.cohort_size, "population": self.population, "versions": self.ledger.applied,
               "accountant": self.settings.accountant, "next_clip": self.clip.clip, **self.last}
        if self.settings.target_epsilon:
            out["target_epsilon"] = self.settings.target_epsilon
        if self.stopped:
            out["stopped"] = self.stopped
        return out

    def state(self) -> dict[str, Any]:
        target = self.settings.target_epsilon
        return {**self.ledger.state(), **self.clip.state(), "epsilon": self.spent, "target_epsilon": target,
                # what the next version would bring it to: `status` says whether a round can still open
                "next_epsilon": self.ledger.epsilon((self.sampling, self.z)) if target else None}

    def load_state(self, state: dict[str, Any]) -> None:
        self.ledger.load_state(state)
        self.clip.load_state(state)


def private_rounds_for(settings: RoundSettings, enrolled: int) -> PrivateRounds | None:
    """[privacy] mode = "central": a stage that replaces the round's fold by the private mean, and says so."""
    if not settings.privacy.on:
        return None
    privacy = PrivateRounds(settings.privacy, settings.privacy.population or enrolled, settings.clients_per_round,
                            settings.buffer_size if settings.mode == "buffered" else 0)
    log.info("[privacy] mode = \"central\": every version is the private mean of updates clipped to C, "
             "noised once, in place of [fold] aggregator = %r and weighting = %r: a robust fold's or a "
             "weighted mean's sensitivity to one device is not bounded by C", settings.aggregator, settings.weighting)
    if advice := uplink_advice(settings.codec):
        log.warning(advice)
    return privacy
