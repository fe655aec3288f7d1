"""The `[privacy]` section: user-level differential privacy of the released models (docs/PRIVACY.md).

    [privacy]
    mode = "central"          # off (the default) | central: the coordinator clips, averages over a
                              # fixed denominator and adds Gaussian noise once per applied version
    target_epsilon = 8.0      # the budget; the noise multiplier is computed from it for planned_rounds ...
    noise_multiplier = 0.0    # ... or give z yourself; with both, z is yours and target_epsilon
                              # is only the budget that stops rounds
    delta = 1e-5              # refused at 1/N or above, for N enrolled devices
    planned_rounds = 40       # the rounds target_epsilon is spread over (needed with target_epsilon)
    population = 0            # N, the devices a cohort is drawn from; 0 = every device known at start
    clip = "adaptive"         # "adaptive" (Andrew et al., NeurIPS 2021: a private quantile of the update
                              # norms, its own noise accounted) or a fixed L2 norm, e.g. 0.5
    clip_initial = 0.1        # adaptive: the first round's clip
    target_quantile = 0.5     # adaptive: the fraction of updates left unclipped it steers to
    clip_learning_rate = 0.2  # adaptive: C <- C exp(-rate (unclipped fraction - target_quantile))
    clip_count_stddev = 0.0   # adaptive: noise on the unclipped count; 0 = max(m / 20, z)
    sampling = "poisson"      # poisson: each device joins a round with probability q = m / N (accounted
                              # as Poisson subsampling); fixed: exactly m of the eligible devices
                              # (accounted as sampling without replacement, replace-one neighbours)
    accountant = "rdp"        # rdp | pld, both from Google's dp-accounting (pip install edgefl[privacy])
    device = "off"            # off | dp-sgd: each device also trains with sample-level DP-SGD (Opacus on the
                              # device: pip install 'edgefl[device-privacy]'), and reports its own epsilon
    device_noise_multiplier = 1.0  # dp-sgd: z, noise std over the per-example clip
    device_clip = 1.0         # dp-sgd: each example's gradient clipped to this L2 norm
    device_delta = 1e-5       # dp-sgd: the delta of the device's own epsilon (over its samples)

m is [schedule] clients_per_round (0: every device, q = 1). Everything here is checked at load;
what privacy rules out in the rest of the configuration is `composition`'s to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PRIVACY_MODES = ("off", "central")
DEVICE_MODES = ("off", "dp-sgd")
SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")
MISSING = ("[privacy] mode = \"central\" needs Google's dp-accounting: pip install 'edgefl[privacy]' "
           "(or pip install dp-accounting)")


@dataclass
class PrivacySettings:
    mode: str = "off"
    target_epsilon: float = 0.0  # 0: no budget of its own (give noise_multiplier)
    noise_multiplier: float = 0.0  # 0: computed from target_epsilon
    delta: float = 1e-5
    planned_rounds: int = 0
    population: int = 0  # N; 0 = counted when the coordinator starts
    clip: Any = "adaptive"  # "adaptive" or a positive number
    clip_initial: float = 0.1
    target_quantile: float = 0.5
    clip_learning_rate: float = 0.2
    clip_count_stddev: float = 0.0
    sampling: str = "poisson"
    accountant: str = "rdp"
    device: str = "off"
    device_noise_multiplier: float = 1.0
    device_clip: float = 1.0
    device_delta: float = 1e-5

    @property
    def on(self) -> bool:
        return self.mode == "central"

    @property
    def device_dp(self) -> bool:
        return self.device == "dp-sgd"

    def device_hparams(self) -> dict[str, float]:
        """What a task tells each device when it trains with DP-SGD ({} when it does not)."""
        if not self.device_dp:
            return {}
        return {"dp_sgd_noise": self.device_noise_multiplier, "dp_sgd_clip": self.device_clip,
                "dp_sgd_delta": self.device_delta}

    @property
    def adaptive(self) -> bool:
        return self.clip == "adaptive"

    def validate(self) -> None:
        if self.mode not in PRIVACY_MODES:
            raise ValueError(f"mode must be one of {', '.join(PRIVACY_MODES)}, got {self.mode!r}")
        self._validate_device()
        if not self.on:
            return
        clip_ok = self.clip == "adaptive" or (isinstance(self.clip, (int, float)) and not isinstance(self.clip, bool)
                                              and self.clip > 0)
        checks = [
            (self.target_epsilon > 0 or self.noise_multiplier > 0,
             "set target_epsilon (the noise is computed from it) or noise_multiplier (z)"),
            (self.target_epsilon >= 0 and self.noise_multiplier >= 0,
             "target_epsilon and noise_multiplier must be >= 0"),
            (0 < self.delta < 1, f"delta must be in (0, 1), got {self.delta}"),
            (self.planned_rounds >= 1 or self.noise_multiplier > 0,
             "target_epsilon needs planned_rounds >= 1: the rounds the budget is spread over"),
            (self.planned_rounds >= 0 and self.population >= 0, "planned_rounds and population must be >= 0"),
            (clip_ok, f"clip must be \"adaptive\" or a positive L2 norm, got {self.clip!r}"),
            (self.clip_initial > 0, "clip_initial must be > 0"),
            (0 < self.target_quantile < 1, "target_quantile must be in (0, 1)"),
            (self.clip_learning_rate > 0, "clip_learning_rate must be > 0"),
            (self.clip_count_stddev >= 0, "clip_count_stddev must be >= 0 (0 = max(m / 20, z))"),
            (self.sampling in SAMPLINGS, f"sampling must be one of {', '.join(SAMPLINGS)}, got {self.sampling!r}"),
            (self.accountant in ACCOUNTANTS,
             f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}"),
            (not (self.sampling == "fixed" and self.accountant == "pld"),
             "sampling = \"fixed\" is accounted as sampling without replacement, which dp-accounting's PLD "
             "accountant does not support: set accountant = \"rdp\", or sampling = \"poisson\""),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        require_accounting()

    def _validate_device(self) -> None:
        if self.device not in DEVICE_MODES:
            raise ValueError(f"device must be one of {', '.join(DEVICE_MODES)}, got {self.device!r}")
        if not self.device_dp:
            return
        for name, ok, need in (("device_noise_multiplier", 0 < self.device_noise_multiplier < 1e3, "in (0, 1000)"),
                               ("device_clip", 0 < self.device_clip < 1e6, "in (0, 1e6)"),
                               ("device_delta", 0 < self.device_delta < 1, "in (0, 1)")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
                raise ValueError(f"{name} must be {need} with device = \"dp-sgd\", got {value!r}")

    def check_population(self, population: int) -> None:
        """delta must be below 1/N: at 1/N a mechanism that publishes one device's data outright is
        (0, delta)-private, so the guarantee would say nothing."""
        if self.on and population > 0 and self.delta >= 1.0 / population:
            raise ValueError(f"delta = {self.delta:g} is at or above 1/N = 1/{population}: a guarantee that "
                             f"allows publishing one device's data outright; set delta below {1.0 / population:.3g} "
                             "(1e-5 or 1/N^1.1 are usual)")


def require_accounting() -> None:
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        raise ValueError(MISSING) from None
