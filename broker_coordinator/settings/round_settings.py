"""What a round is run with (`RoundSettings`, the engine's one view of the round sections of the
coordinator's config) and what it leaves behind (`RoundRecord`, one per attempt).

The config gives the round keys in sections (`round_sections`: [schedule], [algorithm], [fold],
[server_optimizer], [transfer], [evaluation], and [privacy]); `RoundSettings.from_sections` puts
them together under the field names the engine reads, and `sections()` takes them apart again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from broker_coordinator.settings import composition
from broker_coordinator.settings.choices import (
    DEFAULT_AGGREGATOR,
    DEFAULT_AGREEMENT_FLAGS,
    DEFAULT_AGREEMENT_FLOOR,
    DEFAULT_KINSHIP,
    DEFAULT_SERVER_LR,
)
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_sections import ROUND_SECTIONS, RoundSections, training_hparams
from edgefl_protocol import algorithms, codec, delta_downlink, downlink
from edgefl_protocol.settings import build_section


@dataclass
class RoundSettings:
    """Every key of the round sections under its own name, and [privacy]: what the engine reads. Each
    key's section, and what it does, is in `round_sections`; the defaults here are the same."""

    algorithm: str = algorithms.DEFAULT_ALGORITHM
    clients_per_round: int = 0  # 0: every eligible device
    selection: str = "random"
    local_epochs: int = 0  # 0: each device chooses from its measured speed and the deadline (the field default)
    batch_size: int = 32
    lr: float = 0.05
    lr_decay: float = 0.998  # per round
    momentum: float = 0.0
    weight_decay: float = 1e-3
    grad_clip: float = 10.0
    round_timeout: float = 300.0  # seconds from task to deadline
    min_updates: int = 1  # quorum needed to close a round at its deadline
    max_attempts: int = 3  # tries per round without quorum before giving up; 0 = keep trying
    normalize_steps: bool = False  # FedNova-style normalization by local steps
    # uplink codec the tasks name (see edgefl_protocol.codec); "auto": top-k for models of at least
    # codec.TOPK_MIN_VALUES parameters, dense 4-bit below (the coordinator resolves it)
    codec: str = codec.AUTO
    model_codec: str = "float32"  # downlink: float32 (lossless) or float16, optionally +zlib
    model_chunk_bytes: int = downlink.DEFAULT_CHUNK_BYTES
    # "delta": a device holding one of the last downlink_chain versions gets lossy deltas in
    # downlink_codec, "full": every device fetches the whole model (edgefl_protocol/delta_downlink.py)
    downlink: str = delta_downlink.DEFAULT_MODE
    downlink_codec: str = delta_downlink.DEFAULT_CODEC
    downlink_chain: int = delta_downlink.DEFAULT_CHAIN
    max_update_norm: float = 0.0  # reject deltas whose L2 norm exceeds this; 0 = no hard bound
    # what a device's update may weigh and how far it may move the model (see broker_coordinator/aggregation/trust.py)
    weighting: str = "capped"  # capped | uniform | reported (the device's own sample count)
    weight_cap: float = 2.0  # capped: at most this times the median trusted sample count
    norm_bound: float = 1.5  # clip deltas to this times the median norm of recent ones; 0 = off
    # centered_clip | mean (both streaming, O(model)) | gated_mean | trimmed_mean | median | geomed (see broker_coordinator/aggregation/robust.py)
    aggregator: str = DEFAULT_AGGREGATOR
    trim: float = 0.2  # trimmed_mean: fraction dropped at each end, per coordinate
    # streaming folds: a coordinate moves only where at least this fraction of the round's updates agree on
    # its sign (net votes); 0 = off (robust learning rate, Ozdayi et al., AAAI 2021; see aggregation/votes.py)
    sign_quorum: float = 0.0
    # centered_clip: flag a device whose updates depart from their rounds the way another device's do
    # (colluders, backdoors) when the cosine of their paths exceeds this; 0 = off (aggregation/consensus.py)
    kinship: float = DEFAULT_KINSHIP
    # centered_clip: flag an update as pointing away from its round only when its median cosine with the
    # round's others is below -agreement_floor (a margin over the sketch's error); 0 = below 0 suffices
    agreement_floor: float = DEFAULT_AGREEMENT_FLOOR
    # centered_clip: the flags among a device's last 5 judged updates before its weight falls; 1 = at the first
    # (a flagged update that copies another of its round counts twice)
    agreement_flags: int = DEFAULT_AGREEMENT_FLAGS
    # centered_clip: fold the round's updates into this many partial sums, so that its flags reach its own
    # updates (a flagged update's sum at 5%); memory this x model; 0 = flags act from the next update on
    # (aggregation/banks.py)
    verdict_banks: int = 0
    # streaming folds: weigh each update by its cosine with the update the coordinator trains on [federation]
    # root_data from the same model, leaving out those at 0 or below (FLTrust; aggregation/robust.py); opt-in
    root_trust: bool = False
    reference: str = "auto"  # gated_mean's direction: "root" (needs root data), "median", or "auto" (root if given)
    # evaluate, keep and release an EMA of the global models with this decay (devices still train from the last
    # one); 0 = the last model. 0.75: one bad round moves the served model a quarter as far (bench/results/attacks.json)
    serve_average: float = 0.75
    # where the global model is evaluated: "central" (the coordinator's test set), "devices" (each selected
    # device on its held-out slice, sample-weighted), "both", or "auto" (central when there is a test set,
    # else devices)
    evaluate: str = "auto"
    eval_only_every: int = 0  # every Nth round only evaluates on the devices (no training); 0 = never
    hparams: dict[str, float] = field(default_factory=dict)  # algorithm-specific, over its defaults
    # "sync": lock-step rounds; "buffered": FedBuff-style asynchronous versions (see broker_coordinator/engine/buffered.py)
    mode: str = "sync"
    buffer_size: int = 5  # buffered: accepted updates per applied version (FedBuff's K)
    max_staleness: int = 4  # buffered: accept updates trained up to this many versions ago (S); older are dropped
    staleness_weight: str = "inverse_sqrt"  # buffered: an update s versions old counts 1/sqrt(1+s), or 1 ("constant")
    # applied to the server rule's step each round / buffered version (broker_coordinator/aggregation/server_optimizer.py;
    # Reddi et al., ICLR 2021): sgd | momentum | adam | yogi | adagrad; sgd at server_lr 1 is the server rule alone
    server_optimizer: str = "sgd"
    server_lr: float | None = None  # None: the optimizer's default (choices.DEFAULT_SERVER_LR)
    server_lr_decay: float = 1.0  # server_lr is multiplied by this per applied step (round or version); 1 = fixed
    server_momentum: float = 0.9  # momentum: m <- server_momentum * m + step
    beta1: float = 0.9  # adam, yogi, adagrad: the first moment's decay
    beta2: float = 0.99  # adam, yogi: the second moment's decay
    tau: float = 1e-3  # adam, yogi, adagrad: the adaptivity (added to sqrt(v))
    # the [privacy] section (its own, not a [rounds] key; settings/privacy_settings.py)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)

    @classmethod
    def from_sections(cls, sections: RoundSections) -> RoundSettings:
        """What the engine runs with, from the config's round sections (each validated on its own)."""
        values = {f.name: getattr(getattr(sections, name), f.name)
                  for name, section in ROUND_SECTIONS.items() for f in fields(section)}
        return cls(**values, privacy=sections.privacy)

    def sections(self) -> RoundSections:
        """These settings as the config's sections ([schedule], [algorithm], [fold], ...)."""
        built = {name: section(**{f.name: getattr(self, f.name) for f in fields(section)})
                 for name, section in ROUND_SECTIONS.items()}
        return RoundSections(**built, privacy=self.privacy)

    def validate(self) -> None:
        """Each section's ranges (a ValueError starts with the key at fault), then what composes."""
        if isinstance(self.privacy, dict):
            self.privacy = build_section(PrivacySettings, self.privacy, "[privacy]")
        self.privacy.validate()
        sections = self.sections()
        for name in ROUND_SECTIONS:
            getattr(sections, name).validate()
        self.check_together()

    def check_together(self) -> None:
        """What spans sections: the schedule's compositions (config.load_config adds the topology's)."""
        composition.check(self, "flat")

    def server_step_size(self) -> float:
        """The server optimizer's learning rate: server_lr, or the optimizer's default when unset."""
        if self.server_lr is not None:
            return self.server_lr
        if self.server_optimizer == "momentum":
            return round(1.0 - self.server_momentum, 12)
        return DEFAULT_SERVER_LR.get(self.server_optimizer, 1.0)

    def evaluation(self, has_test_set: bool) -> tuple[bool, bool]:
        """(central, on devices): where each round's model is evaluated. Raises ValueError when the
        operator asked for a central evaluation without a test set."""
        if self.evaluate == "central" and not has_test_set:
            raise ValueError("evaluate = \"central\" needs a test set: set [federation] test_data, or use "
                             "\"devices\" (the devices' held-out slices)")
        central = has_test_set and self.evaluate in ("auto", "central", "both")
        devices = self.evaluate in ("devices", "both") or (self.evaluate == "auto" and not has_test_set)
        return central, devices

    def evaluation_only(self, round_no: int) -> bool:
        """Whether the operator scheduled this round to evaluate on the devices without training."""
        return self.eval_only_every > 0 and round_no % self.eval_only_every == 0

    def task_hparams(self, round_no: int) -> dict[str, float]:
        return {**training_hparams(self, round_no), **self.privacy.device_hparams()}


@dataclass
class RoundRecord:
    round: int
    attempt: int
    participants: int
    selected: int
    accuracy: float
    loss: float
    bytes_up: int
    seconds: float
    rejected: dict[str, int]
    closed: str  # "complete" | "deadline" | "abandoned"
    base_sha256: str
    model_sha256: str
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)  # {"norm": n, "weight": m}: bounded, not rejected
    refused: dict[str, str] = field(default_factory=dict)  # device -> why it refused the task
    reason: str = ""
    metric: str = "accuracy"  # the task's metric (edgefl_models.objectives): accuracy, mse or mae
    score: float = float("nan")  # the central evaluation's metric; NaN without a test set
    # the devices' evaluation of the model this round started from, sample-weighted:
    # {"metric", "score", "loss", "count", "devices", "model_version"}; {} when devices did not evaluate
    federated: dict[str, Any] = field(default_factory=dict)
    kind: str = "train"  # "train", or "evaluate" for an evaluation-only round
    bytes_down: int = 0  # model bytes the participants report receiving since their last update
    global_score: float | None = None  # downlink = "delta": `score` of the server rule's G (`score` is B's)
    left_out: float = 0.0  # fraction of the accepted updates the fold left out (an abandoned attempt: all)
    # [privacy] mode = "central": {"epsilon" spent at "delta" after this round, "noise_multiplier", "clip",
    # "noise_std" of the mean, "unclipped_fraction" (noisy), ...} (engine/private_rounds.py); {} when off
    privacy: dict[str, Any] = field(default_factory=dict)
    unvoted: float | None = None  # sign_quorum: the fraction of parameters the round's votes held still; None: off


def check_buffered(settings: RoundSettings) -> None:
    """The ranges of the buffer's keys ([schedule] buffer_size, max_staleness, staleness_weight); a
    ValueError names the key at fault. What buffered mode runs together with is `composition`'s to say."""
    settings.sections().schedule.validate_buffer()


def check_server_optimizer(settings: RoundSettings) -> None:
    """The [server_optimizer] keys' ranges; a ValueError names the key at fault."""
    settings.sections().server_optimizer.validate()
