"""The sections of the coordinator's config that say how rounds run: one dataclass per section,
each key with its default and one line on what it does, each section validated at start-up with
an error naming its key.

    [schedule]          when a round runs and which devices it asks (sync rounds or buffered versions)
    [algorithm]         what the devices train: the algorithm, its hyper-parameters, local SGD
    [fold]              how the round's updates are judged, bounded and combined into one step
    [server_optimizer]  how that step is applied to the global model
    [transfer]          how updates and models cross the broker: codecs, chunks, downlink deltas
    [evaluation]        where the model is evaluated, and which model is served
    [privacy]           user-level differential privacy (its own module: privacy_settings.py)

In release 0.1 every one of these keys sat in `[rounds]`; `round_config` still reads them there.
`RoundSettings.from_sections` assembles the sections into what the engine runs with; the checks
that span sections (what composes with what) are `composition`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from broker_coordinator.settings.choices import (
    AGGREGATORS,
    AGREEMENT_WINDOW,
    DEFAULT_AGGREGATOR,
    DEFAULT_AGREEMENT_FLAGS,
    DEFAULT_AGREEMENT_FLOOR,
    DEFAULT_KINSHIP,
    EVALUATE_MODES,
    MODES,
    POLICIES,
    SERVER_OPTIMIZERS,
    STALENESS_WEIGHTS,
    WEIGHTINGS,
)
from broker_coordinator.settings.privacy_settings import PrivacySettings
from edgefl_protocol import algorithms, codec, delta_downlink, downlink
from edgefl_protocol.errors import Rejected
from edgefl_protocol.task_limits import check_training


class SettingError(ValueError):
    """A value out of its range; the message starts with the key, which `key` names."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _check(section: Any, checks: list[tuple[str, bool, str]]) -> None:
    """Raise SettingError for the first (key, ok, what the key must be) that is not ok."""
    for key, ok, must in checks:
        if not ok:
            raise SettingError(key, f"{key} {must}, got {getattr(section, key)!r}")


def _keyed(exc: ValueError) -> SettingError:
    """A ValueError whose message starts with the key at fault ("key must ...", "key: ...")."""
    text = str(exc)
    return SettingError(text.split(None, 1)[0].rstrip(":"), text)


@dataclass
class ScheduleSettings:
    """`[schedule]`: when a round runs and which devices it asks."""

    mode: str = "sync"  # "sync": lock-step rounds; "buffered": FedBuff-style asynchronous versions
    clients_per_round: int = 0  # devices tasked per round (buffered: kept busy at once); 0 = every eligible one
    selection: str = "random"  # how they are chosen: random | stability (DR-SAM's: low tau, high gamma first)
    round_timeout: float = 300.0  # seconds from a task to its deadline
    min_updates: int = 1  # sync: the quorum that closes a round at its deadline
    max_attempts: int = 3  # sync: tries of a round without quorum before giving up; 0 = keep trying
    buffer_size: int = 5  # buffered: accepted updates per applied version (FedBuff's K)
    max_staleness: int = 4  # buffered: accept updates trained up to this many versions ago (S); older are dropped
    staleness_weight: str = "inverse_sqrt"  # buffered: an update s versions old counts 1/sqrt(1+s), or 1 ("constant")

    def validate(self) -> None:
        _check(self, [
            ("mode", self.mode in MODES, f"must be one of {', '.join(MODES)}"),
            ("clients_per_round", self.clients_per_round >= 0, "must be >= 0 (0 = all eligible devices)"),
            ("selection", self.selection in POLICIES, f"must be one of {', '.join(POLICIES)}"),
            ("round_timeout", self.round_timeout > 0, "must be > 0"),
            ("min_updates", self.min_updates >= 1, "must be >= 1"),
            ("max_attempts", self.max_attempts >= 0, "must be >= 0 (0 = unlimited)"),
        ])
        if self.mode == "buffered":  # a sync schedule ignores the buffer's keys, and always has
            self.validate_buffer()

    def validate_buffer(self) -> None:
        _check(self, [
            ("buffer_size", self.buffer_size >= 1, "must be >= 1 (accepted updates per applied version)"),
            ("max_staleness", self.max_staleness >= 0, "must be >= 0 (versions an update may lag behind; 0 accepts "
                                                       "only updates trained on the current version)"),
            ("staleness_weight", self.staleness_weight in STALENESS_WEIGHTS,
             f"must be one of {', '.join(STALENESS_WEIGHTS)}"),
        ])


def training_hparams(s: Any, round_no: int) -> dict[str, float]:
    """What a task tells each device to train with (`s`: an `[algorithm]` section or RoundSettings)."""
    return {
        **algorithms.get(s.algorithm).defaults, **s.hparams,
        "local_epochs": s.local_epochs, "batch_size": s.batch_size,
        "lr": s.lr * s.lr_decay ** (round_no - 1), "momentum": s.momentum,
        "weight_decay": s.weight_decay, "grad_clip": s.grad_clip,
    }


@dataclass
class AlgorithmSettings:
    """`[algorithm]`: what the devices train (docs/ALGORITHMS.md)."""

    algorithm: str = algorithms.DEFAULT_ALGORITHM  # the client and server rule: dynsam, fedavg, fedprox, fedsam, ...
    hparams: dict[str, float] = field(default_factory=dict)  # the algorithm's own hyper-parameters, over its defaults
    local_epochs: int = 0  # passes over the local data per task; 0 = each device chooses (its speed, the deadline)
    batch_size: int = 32  # local mini-batch size
    lr: float = 0.05  # local learning rate in round 1
    lr_decay: float = 0.998  # lr is multiplied by this each round
    momentum: float = 0.0  # local SGD momentum
    weight_decay: float = 1e-3  # local L2 weight decay
    grad_clip: float = 10.0  # local gradient-norm clip

    def validate(self) -> None:
        try:
            algorithm = algorithms.get(self.algorithm)
        except ValueError as exc:
            raise SettingError("algorithm", f"algorithm: {exc}") from None
        unknown = sorted(set(self.hparams) - set(algorithm.defaults))
        if unknown:
            raise SettingError("hparams", f"hparams: {self.algorithm} has no hyper-parameter {', '.join(unknown)}; "
                                          f"it takes {', '.join(sorted(algorithm.defaults)) or 'none'}")
        _check(self, [
            ("local_epochs", self.local_epochs >= 0, "must be >= 0 (0 = chosen by each device)"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("lr", self.lr > 0, "must be > 0"),
            ("lr_decay", 0 < self.lr_decay <= 1, "must be in (0, 1]"),
            ("momentum", 0 <= self.momentum < 1, "must be in [0, 1)"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
        ])
        try:  # the algorithm's own ranges (e.g. dual_decay), at start-up rather than in the first round
            algorithm.server(training_hparams(self, 1))
        except ValueError as exc:
            raise SettingError("hparams", f"hparams: {exc}") from None
        try:  # the ranges every agent enforces: a task they would all refuse is a config error here
            check_training(training_hparams(self, 1))
        except Rejected as exc:
            refused = ValueError(f"{exc.detail} (agents refuse tasks outside edgefl_protocol.task_limits)")
            raise _keyed(refused) from None


@dataclass
class FoldSettings:
    """`[fold]`: how a round's updates are judged, bounded and combined (docs/ARCHITECTURE.md, "Trust")."""

    aggregator: str = DEFAULT_AGGREGATOR  # centered_clip | mean (both stream) | gated_mean | trimmed_mean | median | geomed
    weighting: str = "capped"  # what a device's sample count may weigh: capped | uniform | reported (its own count)
    weight_cap: float = 2.0  # capped: at most this times the median trusted sample count
    norm_bound: float = 1.5  # clip each delta to this times the median norm of recent ones; 0 = off
    max_update_norm: float = 0.0  # reject deltas whose L2 norm exceeds this; 0 = no hard bound
    normalize_steps: bool = False  # FedNova: normalize each delta by its device's local steps
    trim: float = 0.2  # trimmed_mean: the fraction dropped at each end, per coordinate
    reference: str = "auto"  # gated_mean's direction: root ([federation] root_data) | median | auto (root if given)
    sign_quorum: float = 0.0  # streaming folds: a coordinate moves only where this share of updates agree on its sign; 0 = off
    kinship: float = DEFAULT_KINSHIP  # centered_clip: flag devices whose updates depart alike (path cosine over it); 0 = off
    agreement_floor: float = DEFAULT_AGREEMENT_FLOOR  # centered_clip: an update points away below -this median cosine
    agreement_flags: int = DEFAULT_AGREEMENT_FLAGS  # centered_clip: flags in a device's last 5 judged updates before its weight falls
    verdict_banks: int = 0  # centered_clip: partial sums that let a round's flags hold back its own updates; 0 = off
    root_trust: bool = False  # streaming folds: weigh each update by its cosine with the coordinator's own update on [federation] root_data (FLTrust); at 0 or below it is left out

    def validate(self) -> None:
        _check(self, [
            ("aggregator", self.aggregator in AGGREGATORS, f"must be one of {', '.join(AGGREGATORS)}"),
            ("weighting", self.weighting in WEIGHTINGS, f"must be one of {', '.join(WEIGHTINGS)}"),
            ("weight_cap", self.weight_cap >= 1, "must be >= 1 (times the median trusted sample count)"),
            ("norm_bound", self.norm_bound == 0 or self.norm_bound >= 1,
             "must be 0 (off) or >= 1 (times the median norm of recent updates)"),
            ("max_update_norm", self.max_update_norm >= 0, "must be >= 0 (0 = no bound)"),
            ("trim", 0 <= self.trim < 0.5, "must be in [0, 0.5)"),
            ("reference", self.reference in ("auto", "median", "root"), "must be auto, median or root"),
            ("sign_quorum", 0 <= self.sign_quorum < 1, "must be in [0, 1) (0 = off)"),
            ("kinship", 0 <= self.kinship < 1, "must be in [0, 1) (the path cosine above which a device is "
                                               "flagged; 0 = off)"),
            ("agreement_floor", 0 <= self.agreement_floor < 1,
             "must be in [0, 1) (the median cosine below whose negative an update counts as pointing away; 0 = below 0)"),
            ("agreement_flags", type(self.agreement_flags) is int and 1 <= self.agreement_flags <= AGREEMENT_WINDOW,
             f"must be an integer from 1 (a device's weight falls at its first flag) to {AGREEMENT_WINDOW} (the judged "
             "updates a device's flags are counted over)"),
            ("root_trust", isinstance(self.root_trust, bool), "must be true or false"),
            ("verdict_banks", type(self.verdict_banks) is int and 0 <= self.verdict_banks <= 64,
             "must be an integer from 0 (off) to 64 (partial sums of the model a round keeps)"),
        ])


@dataclass
class ServerOptimizerSettings:
    """`[server_optimizer]`: how the fold's step is applied to the global model (Reddi et al., ICLR 2021)."""

    server_optimizer: str = "sgd"  # sgd | momentum | adam | yogi | adagrad; sgd at server_lr 1 is the server rule alone
    server_lr: float | None = None  # the step size; unset: the optimizer's default (1, 1 - server_momentum, 0.01, 0.1)
    server_lr_decay: float = 1.0  # server_lr is multiplied by this per applied step (round or version); 1 = fixed
    server_momentum: float = 0.9  # momentum: m <- server_momentum * m + step
    beta1: float = 0.9  # adam, yogi, adagrad: the first moment's decay
    beta2: float = 0.99  # adam, yogi: the second moment's decay
    tau: float = 1e-3  # adam, yogi, adagrad: the adaptivity (added to sqrt(v))

    def validate(self) -> None:
        _check(self, [
            ("server_optimizer", self.server_optimizer in SERVER_OPTIMIZERS,
             f"must be one of {', '.join(SERVER_OPTIMIZERS)}"),
            ("server_lr", self.server_lr is None or 0 < self.server_lr <= 10,
             "must be in (0, 10] (1 with sgd is the server rule's own step)"),
            ("server_lr_decay", 0 < self.server_lr_decay <= 1,
             "must be in (0, 1] (per applied step; 1 = a fixed step)"),
            ("server_momentum", 0 <= self.server_momentum < 1, "must be in [0, 1)"),
            ("beta1", 0 <= self.beta1 < 1, "must be in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "must be in [0, 1)"),
            ("tau", self.tau > 0, "must be > 0 (the adaptivity added to sqrt(v); Reddi et al. use 1e-3)"),
        ])


@dataclass
class TransferSettings:
    """`[transfer]`: how updates and models cross the broker (docs/ARCHITECTURE.md, "The downlink")."""

    codec: str = codec.AUTO  # the devices' uplink codec, e.g. float32, q8, topk0.1+q4c64+zlib; auto: by model size
    model_codec: str = "float32"  # the full model's downlink codec: float32 (lossless) or float16, optionally +zlib
    model_chunk_bytes: int = downlink.DEFAULT_CHUNK_BYTES  # the largest model chunk the coordinator publishes
    downlink: str = delta_downlink.DEFAULT_MODE  # full: devices fetch the whole model; delta: recent holders get deltas
    downlink_codec: str = delta_downlink.DEFAULT_CODEC  # delta: the deltas' (lossy) codec
    downlink_chain: int = delta_downlink.DEFAULT_CHAIN  # delta: versions whose deltas stay retained

    def validate(self) -> None:
        _check(self, [("model_chunk_bytes", self.model_chunk_bytes >= 1024, "must be >= 1024")])
        for key, check in (("codec", lambda: codec.check(self.codec)),
                           ("model_codec", lambda: downlink.check_model_codec(self.model_codec))):
            try:
                check()
            except ValueError as exc:
                raise SettingError(key, f"{key}: {exc}") from None
        try:
            delta_downlink.check_settings(self.downlink, self.downlink_codec, self.downlink_chain, self.model_codec)
        except ValueError as exc:
            raise _keyed(exc) from None


@dataclass
class EvaluationSettings:
    """`[evaluation]`: where each round's model is evaluated, and which model is served."""

    evaluate: str = "auto"  # central (the test set) | devices (their held-out slices) | both | auto (central if one)
    eval_only_every: int = 0  # every Nth round only evaluates on the devices (no training); 0 = never
    serve_average: float = 0.75  # evaluate, keep and serve an EMA of the global models of this decay; 0 = the last one

    def validate(self) -> None:
        _check(self, [
            ("evaluate", self.evaluate in EVALUATE_MODES, f"must be one of {', '.join(EVALUATE_MODES)}"),
            ("eval_only_every", self.eval_only_every >= 0, "must be >= 0 (0 = no evaluation-only rounds)"),
            ("serve_average", 0 <= self.serve_average < 1,
             "must be in [0, 1) (the decay of the served moving average of global models; 0 = serve the last one)"),
        ])


# the round sections in the order the docs list them; [privacy] is the one with a module of its own
ROUND_SECTIONS: dict[str, type] = {
    "schedule": ScheduleSettings, "algorithm": AlgorithmSettings, "fold": FoldSettings,
    "server_optimizer": ServerOptimizerSettings, "transfer": TransferSettings, "evaluation": EvaluationSettings,
}
# each round key -> its section (every key keeps its name; only its section is new)
PLACES: dict[str, str] = {f.name: name for name, cls in ROUND_SECTIONS.items() for f in fields(cls)}


@dataclass
class RoundSections:
    """The round sections of one config, each built and validated on its own."""

    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    fold: FoldSettings = field(default_factory=FoldSettings)
    server_optimizer: ServerOptimizerSettings = field(default_factory=ServerOptimizerSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    evaluation: EvaluationSettings = field(default_factory=EvaluationSettings)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)
