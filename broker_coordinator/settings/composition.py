"""Which features run together: the one check of a federation's composition, at config load.

A feature either works in every schedule (`sync`, `buffered`) and topology (`flat`, `sites`), or
one rule here refuses the combination with its reason. `run`, `simulate`, `site-aggregator` and
`broker-config` all load their settings through it (`RoundSettings.validate` for the schedule,
`config.load_config` and `Engine` for the topology), so a refusal is worded once and always
comes before anything starts. docs/ARCHITECTURE.md lists `RULES` ("What runs together").

Each rule says whether its reason is mathematical (the combination cannot be defined), measured
(it was built and run, and the benchmark named in the reason says it does not work), or that the
combination is not built yet (it could be; nothing was built or measured for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from broker_coordinator.settings.choices import DEFAULT_AGREEMENT_FLAGS, STREAMING, TOPOLOGIES


class Settings(Protocol):
    """What the rules read of a federation's settings (`RoundSettings` has it all). A protocol, so
    that this module needs nothing of `round_settings`, whose `validate` calls `check`."""

    privacy: Any  # PrivacySettings: .on (central), .device_dp
    algorithm: str
    aggregator: str
    weighting: str
    normalize_steps: bool
    selection: str
    sign_quorum: float
    kinship: float
    agreement_floor: float
    agreement_flags: int
    verdict_banks: int
    mode: str
    eval_only_every: int
    root_trust: bool

    def task_hparams(self, round_no: int) -> dict[str, float]: ...


@dataclass(frozen=True)
class Rule:
    combination: str  # what is refused, in config keys
    kind: str  # "mathematical" | "measured" | "not built"
    reason: str
    applies: Callable[[Settings, str], bool]
    fix: str  # what to set instead
    detail: Callable[[Settings], str] | None = None  # the settings' own words, when they have them


def _private(s: Settings) -> bool:
    return s.privacy.on


def _centered_clip_stage(setting: str, reason: str, off: float = 0) -> Rule:
    """A stage of centered_clip's consensus (on when `setting` is not `off`) asked of a fold that keeps none."""
    return Rule(f"{setting} + aggregator mean | gated_mean | trimmed_mean | median | geomed", "not built", reason,
                lambda s, t: getattr(s, setting) != off and s.aggregator != "centered_clip",
                f'{setting} = {off:g}, or aggregator = "centered_clip"')


def _beyond_the_clip(setting: str, reason: str, off: float = 0) -> Rule:
    """A stage (on when `setting` is not `off`) whose verdict on one device depends on the others' updates of
    the round, under central privacy: its sensitivity would exceed the clip C the noise covers."""
    return Rule(f"privacy central + {setting}", "mathematical", reason,
                lambda s, t: _private(s) and getattr(s, setting) != off, f"{setting} = {off:g}")


def _sam_family(s: Settings) -> bool:
    """Whether the algorithm's client rule takes SAM's ascent step (it overrides `perturbation`)."""
    from edgefl_protocol import algorithms
    from edgefl_protocol.algorithms.base import ClientRule
    return algorithms.get(s.algorithm).client.perturbation is not ClientRule.perturbation


def _reads_devices(s: Settings) -> str:
    """What an algorithm's server rule takes from the devices besides the clipped delta ("" = nothing)."""
    from edgefl_protocol import algorithms
    from edgefl_protocol.algorithms.base import ServerRule
    rule = algorithms.get(s.algorithm).server(s.task_hparams(1))
    if rule.extra_specs({"w": (1,)}):
        return "extra tensors averaged without clipping or noise"
    if type(rule).observe is not ServerRule.observe:
        return "the devices' reported metrics (into its state and the next tasks)"
    return ""


RULES: tuple[Rule, ...] = (
    Rule('topology sites + aggregator gated_mean | trimmed_mean | median | geomed', "mathematical",
         "a site sends up sums, and these folds need every delta of the round in one place (a coordinate-"
         "wise median is not a sum)",
         lambda s, t: t == "sites" and s.aggregator not in STREAMING,
         f"aggregator = one of {', '.join(STREAMING)} (each judges an update as it arrives, at a site as at "
         "the centre)"),
    Rule('privacy central + aggregator gated_mean | trimmed_mean | median | geomed', "mathematical",
         "each device's verdict depends on the other devices' updates of the same round, so one device "
         "can move the aggregate by more than the clip C and the noise no longer covers it",
         lambda s, t: _private(s) and s.aggregator not in STREAMING,
         'aggregator = "mean" (with privacy on, mean and centered_clip are both replaced by the private '
         "clipped mean, whose sensitivity is C)"),
    Rule('privacy central + weighting reported', "mathematical",
         "a device's own sample count would scale its contribution beyond C",
         lambda s, t: _private(s) and s.weighting == "reported",
         'weighting = "uniform" (with privacy on, capped is replaced by uniform too: the fold weighs every '
         "clipped update 1 over a fixed denominator)"),
    Rule('privacy central + normalize_steps', "mathematical",
         "FedNova rescales the mean by the devices' reported local steps, a data-dependent factor beyond C",
         lambda s, t: _private(s) and s.normalize_steps, "normalize_steps = false"),
    Rule('privacy central + selection stability', "mathematical",
         "the cohort would depend on the devices' reported metrics; the accountant assumes uniform sampling",
         lambda s, t: _private(s) and s.selection != "random", 'selection = "random"'),
    Rule('privacy central + an algorithm whose server rule reads the devices', "mathematical",
         "its server state or tasks take what devices report beyond the clipped delta, which no noise covers",
         lambda s, t: _private(s) and bool(_reads_devices(s)),
         'algorithm = "fedavg", "fedprox" or "fedsam"',
         lambda s: f'algorithm = "{s.algorithm}" uses {_reads_devices(s)}'),
    Rule('privacy device dp-sgd + a SAM-family algorithm', "not built",
         "SAM's ascent pass reads the batch a second time each step; DP-SGD would have to clip, noise and "
         "account that pass as well (edge_agent/dp_sgd.py privatizes the one gradient of a plain step)",
         lambda s, t: s.privacy.device_dp and _sam_family(s),
         'algorithm = "fedavg", "fedprox" or "feddyn"',
         lambda s: f'algorithm = "{s.algorithm}" takes a SAM ascent step on the data every step'),
    Rule('sign_quorum + aggregator gated_mean | trimmed_mean | median | geomed', "not built",
         "the sign votes are a stage of the streaming folds (aggregation/votes.py); the folds that hold the "
         "round judge each coordinate their own way (trimmed_mean and median per coordinate already)",
         lambda s, t: s.sign_quorum > 0 and s.aggregator not in STREAMING,
         f"sign_quorum = 0, or aggregator = one of {', '.join(STREAMING)}"),
    _beyond_the_clip("sign_quorum", "whether a coordinate moves depends on the other devices' votes of the same "
                     "round, so one device can switch a coordinate of the whole aggregate on or off: beyond the clip "
                     "C the noise covers"),
    _centered_clip_stage("kinship", "the kinship flag is a stage of centered_clip's consensus "
                                    "(aggregation/consensus.py), which the other folds do not keep"),
    _beyond_the_clip("kinship", "a device is flagged when its path is like another device's, so one device's "
                                "updates can cut another's weight: beyond the clip C the noise covers"),
    _centered_clip_stage("agreement_floor", "the floor is a margin of centered_clip's agreement stage "
                                            "(aggregation/consensus.py), which the other folds do not keep"),
    _beyond_the_clip("agreement_floor", "the agreement stage flags a device by its cosines with the other "
                                        "devices' updates of the same round, beyond the clip C the noise covers; "
                                        "the private fold runs without it"),
    _centered_clip_stage("agreement_flags", "the flags are centered_clip's agreement stage's "
                                            "(aggregation/consensus.py), which the other folds do not keep",
                         off=DEFAULT_AGREEMENT_FLAGS),
    _beyond_the_clip("agreement_flags", "the agreement stage flags a device by its cosines with the other "
                                        "devices' updates of the same round, beyond the clip C the noise covers; "
                                        "the private fold runs without it", off=DEFAULT_AGREEMENT_FLAGS),
    _centered_clip_stage("verdict_banks", "the banks hold back what centered_clip's consensus flags "
                                          "(aggregation/banks.py); the other folds flag nothing"),
    _beyond_the_clip("verdict_banks", "a bank is held back when another device's update in it is flagged, which "
                                      "depends on the other updates of the round: beyond the clip C the noise "
                                      "covers"),
    Rule('root_trust + aggregator gated_mean | trimmed_mean | median | geomed', "not built",
         "the trust score weighs each update as a streaming fold takes it in; gated_mean has its own use of the "
         "root update (reference = \"root\"), and the others fold coordinates, not weighted updates",
         lambda s, t: s.root_trust and s.aggregator not in STREAMING,
         f"root_trust = false (or reference = \"root\" with gated_mean), or aggregator = one of {', '.join(STREAMING)}"),
    Rule('privacy central + root_trust', "mathematical",
         "an update's weight would be its cosine with the root update, and the leftover weight of the round "
         "changes the mean's denominator: the clip C the noise is calibrated to would no longer bound one device",
         lambda s, t: _private(s) and s.root_trust, "root_trust = false"),
    Rule('mode buffered + eval_only_every', "mathematical",
         "buffered mode has no rounds to pause for an evaluation",
         lambda s, t: s.mode == "buffered" and s.eval_only_every != 0,
         "eval_only_every = 0"),
)


def refusals(settings: Settings, topology: str = "flat") -> list[Rule]:
    """The rules that refuse these settings in this topology (empty: they compose)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    return [rule for rule in RULES if rule.applies(settings, topology)]


def check(settings: Settings, topology: str = "flat") -> None:
    """Raise ValueError naming every refused combination, its reason and what to set instead."""
    refused = refusals(settings, topology)
    if refused:
        raise ValueError("; ".join(f"{r.combination} is refused ({r.kind}: "
                                   f"{r.detail(settings) if r.detail else r.reason}); set {r.fix}"
                                   for r in refused))
