"""The local gate: a version reaches the serving store only when it is not worse here.

Before the agent publishes a model version it scores it on the device's held-out data and scores
the current version on the same samples; it keeps the current one when the new one is worse by more
than `gate_margin` (in the metric's units: 0.02 = 2 accuracy points). Without held-out data
([data] holdout = 0) the gate has nothing to judge and every version is published. Each version is
offered once; the decision goes to the log (INFO) and the device's status profile (`serving_*`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from edgefl_protocol import messages
from edgefl_models.architectures import resolve
from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective, format_score

from .config import ServingSettings
from .personalize import personalize
from .serving import load_model, read_current
from .serving_store import ServingStore, StoreError

log = logging.getLogger("edge_agent.serving")


@dataclass(frozen=True)
class Decision:
    version: int
    published: bool
    current: int | None  # the version current before the decision (replaced, or kept)
    metric: str = ""
    new_score: float | None = None
    current_score: float | None = None  # the version it replaced or kept, on the same samples
    released_score: float | None = None  # personalized serving: the released model's score, beside its tuned copy

    def text(self) -> str:
        def score(value: float | None) -> str:
            return "n/a" if value is None else format_score(self.metric, value)
        if self.new_score is None:
            return f"published {self.version} (no held-out data to judge it)"
        if self.released_score is not None:  # the tuned copy won; the versus below is the tuned one's
            personal = f" personalized ({self.metric} {score(self.new_score)}, the release {score(self.released_score)})"
            return ("published" if self.published else f"kept {self.current}, refused") + f" {self.version}{personal}" \
                + (f" vs version {self.current}'s {score(self.current_score)}" if self.current_score is not None else "")
        versus = f"{self.metric} {score(self.new_score)} vs {score(self.current_score)} of version {self.current}"
        if self.published:
            return f"published {self.version}" + (f": {versus}" if self.current_score is not None else
                                                  f": {self.metric} {score(self.new_score)}")
        return f"kept {self.current}, refused {self.version}: {self.metric} {score(self.new_score)} vs " \
               f"{score(self.current_score)}"


class ServingGate:
    """Offers each model version the agent received to the store at `settings.dir`, through the gate."""

    def __init__(self, settings: ServingSettings) -> None:
        self.settings = settings
        self.store = ServingStore(settings.dir, settings.keep, settings.group)
        self.offered: set[int] = set()
        self.errors = 0
        self._said_no_holdout = False
        self._said_no_personalize = False

    def wants(self, version: int) -> bool:
        """Not offered yet, not already in the store, and newer than the current one."""
        current = self.store.current_version()
        return version not in self.offered and not self.store.has(version) and (current is None or version > current)

    def offer(self, release: messages.ModelRelease, round_: int, model: torch.nn.Module, held_out: Dataset,
              objective: Objective, train: Dataset | None = None) -> Decision:
        self.offered.add(release.version)
        current = self.store.current_version()
        new_score = current_score = released_score = None
        detail: dict = {}
        if len(held_out):
            new_score = objective.evaluate(model, held_out).score
            model.train()
            current_score = self._score_current(held_out, objective) if current is not None else None
            mode = self.settings.personalize
            if mode != "off" and train is not None and len(train):  # a copy; the release itself stays as it came
                own = personalize(model, train, objective, mode, self.settings.personalize_steps,
                                  self.settings.personalize_lr, seed=release.version)
                own_score = None if own is None else objective.evaluate(own.model, held_out).score
                if own is None:
                    self._cannot_personalize(mode)
                elif own_score > new_score if objective.higher_is_better else own_score < new_score:
                    model, released_score, new_score, detail = own.model, new_score, own_score, own.detail
        elif not self._said_no_holdout:
            self._said_no_holdout = True
            log.info("serving: no held-out data ([data] holdout = 0): the gate has nothing to judge, every "
                     "model version is published")
        worse = (current_score is not None and new_score is not None and self.settings.gate
                 and (current_score - new_score if objective.higher_is_better else new_score - current_score)
                 > self.settings.gate_margin)
        if worse:
            return Decision(release.version, False, current, objective.metric, new_score, current_score, released_score)
        score = None if new_score is None else {"metric": objective.metric, "value": new_score,
                                                "count": len(held_out)}
        state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
        shape = resolve(release.arch).input_shape  # for model.onnx (a plug-in says its own)
        self.store.publish(release.version, state, {
            "round": round_, "architecture": release.arch, "fingerprint": release.fingerprint,
            "release_sha256": release.sha256, "task": objective.task, "score": score,
            "personalized": None if released_score is None else {
                "how": self.settings.personalize, "released_score": released_score, **detail}},
            onnx_of=(model.eval(), tuple(shape)))
        return Decision(release.version, True, current, objective.metric, new_score, current_score, released_score)

    def _cannot_personalize(self, mode: str) -> None:
        if not self._said_no_personalize:
            self._said_no_personalize = True
            log.info("serving: personalize = %r does not apply to this model (a classification model whose last "
                     "layer has a bias per class): each version is served as released", mode)

    def _score_current(self, held_out: Dataset, objective: Objective) -> float | None:
        """The current version on the same samples; None when it cannot be judged here (another
        architecture, unreadable): the new version is then published."""
        try:
            _, meta, body = read_current(self.store.root)
            return objective.evaluate(load_model(meta, body), held_out).score
        except (StoreError, ValueError, RuntimeError, OSError, KeyError) as exc:
            log.info("serving: cannot score the current version on this data (%s); the new one replaces it", exc)
            return None
