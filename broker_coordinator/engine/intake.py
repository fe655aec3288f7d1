"""What the coordinator does with an answer from a device: validate it, bound it, fold it, and
tell the device what became of it (its receipt).

Every answer is hostile until validated: size cap, then the device's HMAC
signature (before anything is parsed), then sender, federation, replay, round,
attempt and model-version freshness, deadline, cohort, codec, shapes, finite
values and the optional hard norm bound. A rejection is logged with its
reason, counted per reason, sent back in the receipt, and never touches the
global model. An accepted update's receipt carries the fold's verdict on it (`verdicts`):
folded, clipped (to what), left out (why), or pending, with a second receipt when the fold
decides. An identical resend of an accepted update (its receipt was lost) is answered with that
verdict again, also after its round closed, while the replay guard remembers the round.

The same intake runs at the centre and at every site worker. What it judges by is its `terms` (the
coordinator's are fixed for a run; a site's come with each site task), and what counts as fresh is
the schedule's (`Freshness`: a sync round's number and attempt, or a buffered version's tickets).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker_coordinator.aggregation.robust import l2_norm
from broker_coordinator.aggregation.trust import SampleWeights
from broker_coordinator.engine.device_wire import DeviceWire
from broker_coordinator.engine.presence import DevicePresence
from broker_coordinator.engine.rounds import Round
from broker_coordinator.engine.verdicts import LEFT_OUT, NOT_FOLDED, REPLAY_ROUNDS, Verdict, Verdicts
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.settings import limits
from broker_coordinator.settings.choices import STREAMING
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.storage.store import Store
from broker_coordinator.storage.verdict_journal import VerdictJournal
from edgefl_protocol import codec, messages, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.sparse_delta import sparse_only
from edgefl_models.objectives import Objective

log = logging.getLogger("broker_coordinator")
# an accepted update, judged: (delta, weight, steps, the weight's note, its norm if the hard bound took it)
Judged = tuple[dict, float, int, str, float | None]
# rejections that follow from timing (a restart, a slow link, a buffered task overtaken, an update queued
# before a key rotation): logged at INFO, the device told why
ROUTINE = frozenset({"stale", "late", "too_stale", "old_key"})


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


@dataclass
class Terms:
    """What an answer is judged by: the settings, objective and server rule of its round, the model's
    shapes and the sample-weight bound."""
    settings: RoundSettings
    objective: Objective
    server_rule: Any  # the algorithm's ServerRule, or a site's SiteRule
    algorithm: str
    specs: dict[str, tuple[int, ...]]
    extra_specs: dict[str, tuple[int, ...]]
    sample_weights: SampleWeights
    max_values: int = field(init=False)
    max_update_bytes: int = field(init=False)  # the broker's packet limit agrees

    def __post_init__(self) -> None:
        self.max_values = sum(math.prod(shape) for shape in {**self.specs, **self.extra_specs}.values())
        self.max_update_bytes = limits.update_cap(self.specs, self.extra_specs)


class Freshness(Protocol):
    """The schedule's rules for which answers are still wanted, and how much an update weighs for
    being late (engine/sync_rounds.py: rounds; engine/buffered.py: tickets)."""

    def check(self, current: Round | None, device: str, answer: messages.Answer, arrived: float) -> None:
        """Raises Rejected for an answer no open task asked for."""

    def books_to(self, current: Round | None, answered: tuple[int, int]) -> Round | None:
        """The open round a rejected answer to `answered` counts against."""

    def still_open(self, current: Round | None, round_no: int, attempt: int) -> bool:
        """Whether an accepted answer to (round, attempt) is still in the open aggregate."""

    def factor(self, update: messages.Update) -> float:
        """What an accepted update's weight is multiplied by (a buffered update's staleness)."""

    def folded(self, current: Round, device: str, update: messages.Update, weight: float) -> None:
        """An update was folded into `current` with this weight."""


class UpdateIntake:
    def __init__(self, fed: str, terms: Terms, keys: Mapping[str, bytes], presence: DevicePresence,
                 freshness: Freshness, verdicts: Verdicts, metrics: Metrics, store: Store | None,
                 send: Callable[[str, bytes], None], released_sha: Mapping[int, str],
                 closed_at: dict[int, float], journal: VerdictJournal | None = None) -> None:
        self.fed, self.terms, self.presence, self.freshness = fed, terms, presence, freshness
        self.keys: dict[str, bytes] = dict(keys)  # device -> HMAC key (from enrollment)
        self.previous_keys: dict[str, bytes] = {}  # device -> its key before a rotation (`rekey`)
        self.verdicts, self.metrics, self.store = verdicts, metrics, store
        self.send = send  # (topic, payload): how receipts go out
        # receipts (and tasks, topologies' send_tasks) in the protocol version each device speaks
        self.wire = DeviceWire(fed, lambda device: self.keys.get(device), presence.serves, send)
        presence.on_online = self.wire.heard
        self.released_sha = released_sha  # version -> sha256 of its release (empty at a site)
        self.closed_at = closed_at  # round -> when it closed (shared with the schedule's freshness)
        self.journal = journal  # every verdict, written before its receipt: taken back if its round is never saved
        self.rejections: Counter[str] = Counter()
        # (device, round, attempt) -> sha256 of the accepted payload: replay guard, and resends are recognised
        self.accepted: dict[tuple[str, int, int], str] = {}
        self.last_metrics: dict[str, dict[str, Any]] = {}  # what selection policies read

    def closed(self, round_no: int) -> None:
        """A round closed: the replay guard keeps only recent rounds (older answers are late anyway)."""
        self.closed_at[round_no] = time.time()
        self.accepted = {key: digest for key, digest in self.accepted.items() if key[1] > round_no - REPLAY_ROUNDS}
        self.verdicts.forget(round_no - REPLAY_ROUNDS + 1)

    def reject(self, device: str, reason: str, detail: str, current: Round | None = None) -> None:
        self.rejections[reason] += 1
        self.metrics.rejected.labels(reason).inc()
        if device in self.keys:  # an enrolled device: a series of its own (a made-up name gets none)
            self.metrics.device_updates.labels(device, "rejected").inc()
        if current is not None:
            current.rejected[reason] += 1
        # routine after a restart or a slow link (the device is told, nobody must act): INFO
        log.log(logging.INFO if reason in ROUTINE else logging.WARNING, "update from %s rejected: %s: %s",
                device, reason, detail)

    def on_update(self, current: Round | None, device: str, data: bytes, arrived: float) -> None:
        try:
            answer = self._parse(device, data)
        except Rejected as exc:  # not readable as this device's answer: nothing to address a receipt to
            self.presence.pending_until.pop(device, None)
            self._rejected(current, device, exc)
            return
        if self.presence.pending_round.get(device, answer.round) == answer.round:  # not a resend of an older answer
            self.presence.pending_until.pop(device, None)  # whatever its fate, the device is no longer busy with it
        key = (answer.round, answer.attempt)
        try:
            judged = self._judge(current, device, answer, data, arrived)
        except Rejected as exc:
            # booked to the round and attempt it answered: an answer to a closed round is not the open
            # round's rejection (it is logged, counted and stored under the round it names)
            self._rejected(self.freshness.books_to(current, key), device, exc, key)
            vouch = (device, *key) not in self.accepted and (
                self._remembers(answer.round) or (current is not None and answer.round == current.number))
            self._receipt(device, key, exc, Verdict(NOT_FOLDED if vouch else ""))
            return
        if judged is not None:  # None: the same accepted update again (our receipt was lost): answer it again
            assert current is not None
            self._fold(current, device, answer, judged, len(data), hashlib.sha256(data).hexdigest())
        self._receipt(device, key, None, self.verdicts.of((device, *key)))

    def _rejected(self, current: Round | None, device: str, exc: Rejected,
                  answered: tuple[int, int] | None = None) -> None:
        """Count and log a rejection; book it to `current` (the round it answered, or for an unreadable
        message the round it arrived in) and store it under the (round, attempt) it answered."""
        self.reject(device, exc.reason, exc.detail, current)
        where = answered or ((current.number, current.attempt) if current is not None else None)
        if self.store and where is not None:
            self.store.record_device_round(*where, device, False, exc.reason, None)

    def _fold(self, current: Round, device: str, answer: messages.Answer,
              judged: Judged | messages.Refusal | messages.EvalReport, size: int,
              digest: str) -> None:
        if isinstance(answer, messages.EvalReport):
            current.evaluations[device] = (answer.score, answer.loss, answer.count)
            current.answered.add(device)
            self.accepted[(device, answer.round, answer.attempt)] = digest
            current.device_metrics[device] = {f"eval_{answer.metric}": answer.score, "eval_loss": answer.loss,
                                              "eval_count": answer.count}
            if self.store:
                self.store.record_device_round(answer.round, answer.attempt, device, True, None,
                                               current.device_metrics[device])
            return
        if isinstance(answer, messages.Refusal):
            current.refused[device] = f"{answer.reason}: {answer.detail}"
            log.info("%s refused round %d (attempt %d): %s: %s", device, answer.round, answer.attempt,
                        answer.reason, answer.detail)
            if self.store:
                self.store.record_device_round(answer.round, answer.attempt, device, False,
                                               f"refused:{answer.reason}", {"detail": answer.detail})
            return
        assert not isinstance(judged, messages.Refusal)
        delta, weight, steps, weight_note, norm = judged
        if weight_note:
            current.weights_clipped += 1
        model_delta = sparse_only(delta, self.terms.specs)  # the fold's fast paths take a SparseDelta
        mark = Verdicts.mark(current.aggregate, device)
        current.aggregate.add(device, model_delta, weight, steps, norm=norm)
        verdict = self.verdicts.on_fold(current.aggregate, (device, answer.round, answer.attempt), model_delta,
                                        self.terms.settings.aggregator in STREAMING, mark)
        if current.extras is not None:
            current.extras.add({name: delta[name] for name in self.terms.extra_specs}, 1.0)
        self.terms.server_rule.observe(device, answer.num_samples, answer.metrics)
        # a device evaluates the model it received (buffered: its task's version, maybe an older one)
        if (evaluation := self._evaluation_in(device, answer.metrics)) is not None:
            current.evaluations[device] = evaluation
            current.evaluated[device] = answer.model_version
        current.answered.add(device)
        self.accepted[(device, answer.round, answer.attempt)] = digest  # the task answered (buffered: not current's)
        current.device_metrics[device] = dict(answer.metrics, num_samples=answer.num_samples, weight=weight)
        if twice := self.verdicts.double_counted(device, answer.metrics):
            log.warning("update from %s for round %d says it still owes the delta of %s, which this coordinator "
                        "folded: that delta counts twice", device, answer.round, ", ".join(twice))
            self.metrics.bounded.labels("double_count").inc()
            current.device_metrics[device]["double_count"] = " ".join(twice)
        current.bytes_up += size
        self.last_metrics[device] = dict(answer.metrics)
        self.metrics.accepted.inc()
        self.metrics.bytes_up.inc(size)
        if self.store:
            self.store.record_device_round(answer.round, answer.attempt, device, True, None,
                                           current.device_metrics[device], verdict.kind, verdict.detail)
        self.flushed(current)
        self.freshness.folded(current, device, answer, weight)

    def flushed(self, current: Round) -> None:
        """Pending updates the fold has decided (a cold start's flush, or the close): their final receipts."""
        for key, verdict in self.verdicts.settle(current.aggregate):
            self._final_receipt(key, verdict)

    def abandoned(self, rnd: Round) -> None:
        """An abandoned attempt folded nothing: every update it accepted is left out, and told so."""
        for key, verdict in self.verdicts.abandon(rnd.number, rnd.attempt, rnd.reason):
            self._final_receipt(key, verdict)

    def take_back_unsaved(self, first_unsaved_round: int) -> None:
        """Verdicts the last run gave for a round it never saved (killed between the receipts and the
        checkpoint): each device is told its update is in no model, and undoes what it committed."""
        if self.journal is None:
            return
        unsaved = self.journal.unsaved(first_unsaved_round)
        for round_no, attempt, device in unsaved:
            self.take_back((device, round_no, attempt), f"the coordinator restarted before round {round_no} was "
                                                        "saved: this update is in no model")
        self.journal.saved()
        if unsaved:
            log.info("took back %d verdict(s) of round(s) %s, which the last run gave and never saved; the "
                     "devices undo what they committed", len(unsaved),
                     ", ".join(str(r) for r in sorted({key[0] for key in unsaved})))

    def take_back(self, key: tuple[str, int, int], why: str) -> None:
        """A verdict given for a round that was never saved: the update is in no model, and told so."""
        verdict = Verdict(LEFT_OUT, 0.0, why)
        self.verdicts.decided[key] = verdict
        self._final_receipt(key, verdict)

    def _final_receipt(self, key: tuple[str, int, int], verdict: Verdict) -> None:
        if self.store:
            self.store.settle_verdict(key[1], key[2], key[0], verdict.kind, verdict.detail)
        self._receipt(key[0], key[1:], None, verdict)

    def _evaluation_in(self, device: str, metrics: dict) -> tuple[float, float, int] | None:
        """The received model's evaluation an update carries when the task asked for one (eval_score,
        eval_loss, eval_count); a malformed one is left out of the round's evaluation, with a log line."""
        if "eval_count" not in metrics:
            return None
        score, loss, count = metrics.get("eval_score"), metrics.get("eval_loss"), metrics.get("eval_count")
        named = metrics.get("eval_metric")
        if (not isinstance(count, int) or isinstance(count, bool) or count <= 0
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (score, loss))
                or named != self.terms.objective.metric):
            log.warning("update from %s: its evaluation (eval_metric %r, eval_score %r, eval_count %r) is not a "
                        "%s measurement; left out of the round's evaluation", device, named, score, count,
                        self.terms.objective.metric)
            self.metrics.rejected.labels("evaluation").inc()
            return None
        return float(score), float(loss), count

    def _receipt(self, device: str, answer: tuple[int, int], rejected: Rejected | None,
                 verdict: Verdict | None = None) -> None:
        """Tell the device what became of its answer (round, attempt), so that it stops resending, or
        says why in its log: for an accepted update, the fold's verdict; for a rejection, whether
        this coordinator vouches that it never accepted it (`not_folded`)."""
        verdict = verdict or Verdict("")
        if rejected is not None:
            receipt = messages.Receipt(*answer, False, rejected.reason, rejected.detail[:1000], verdict.kind, 0.0)
        else:
            receipt = messages.Receipt(*answer, True, "", verdict.detail[:1000], verdict.kind, verdict.scale)
            if self.journal is not None and verdict.kind:
                self.journal.given(answer[0], answer[1], device, verdict.kind)
        if (payload := self.wire.seal(device, "receipt", receipt)) is not None:
            self.send(topics.receipt(self.fed, device), payload)

    def _remembers(self, round_no: int) -> bool:
        """Whether every update accepted for `round_no` is still in the replay guard: a round this
        process closed, within the guard's window (REPLAY_ROUNDS). A restarted coordinator
        remembers nothing from before (its rejections do not vouch)."""
        return round_no in self.closed_at and round_no > max(self.closed_at) - REPLAY_ROUNDS

    def _weight_and_steps(self, device: str, update: messages.Update) -> tuple[float, int, str]:
        steps = update.metrics.get("steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise Rejected("schema", f"metric 'steps' must be a positive integer, got {steps!r}")
        trusted = self.terms.sample_weights.weigh(device, update.num_samples)
        if trusted.note:
            self.metrics.bounded.labels("weight").inc()
            log.debug("update from %s: %s", device, trusted.note)  # routine for a large shard; counted
        try:
            weight = float(self.terms.server_rule.weight(trusted.weight, update.metrics))
        except (ValueError, TypeError, KeyError) as exc:
            raise Rejected("schema", f"metrics unusable by {self.terms.algorithm}: {exc}") from None
        if not (weight > 0 and weight < float("inf")):
            raise Rejected("schema", f"aggregation weight {weight} is not positive and finite")
        return weight * self.freshness.factor(update), steps, trusted.note

    def _parse(self, device: str, data: bytes) -> messages.Answer:
        """Admission, size cap and the device's signature (before anything is parsed), then the header."""
        refused = self.presence.admission(device) if self.presence.admission else None
        if refused:
            raise Rejected(*refused)
        try:
            answer = messages.decode_answer(data, self.terms.max_update_bytes, self.keys.get(device), device)
        except Rejected as exc:
            if exc.reason == "signature" and self._signed_before_rotation(device, data):
                raise Rejected("old_key", f"signed with {device}'s key from before it was rotated: an update it "
                                          "queued before; its next ones carry the new key") from None
            raise
        if answer.device != device:
            raise Rejected("sender", f"topic says {device} but the update claims {answer.device}")
        if answer.federation != self.fed:
            raise Rejected("federation", f"update is for federation {answer.federation!r}, this is {self.fed!r}")
        return answer

    def rekey(self, keys: Mapping[str, bytes]) -> None:
        """New signing keys (an enrollment, a rotation). A device's previous key is kept, to tell an
        update it queued before its rotation from a forgery."""
        for device, key in self.keys.items():
            if keys.get(device) != key:
                self.previous_keys[device] = key
        self.keys = dict(keys)

    def _signed_before_rotation(self, device: str, data: bytes) -> bool:
        old = self.previous_keys.get(device)
        if old is None:
            return False
        try:
            messages.decode_answer(data, self.terms.max_update_bytes, old, device)
        except Rejected:
            return False
        return True

    def _judge(self, current: Round | None, device: str, answer: messages.Answer, data: bytes,
               arrived: float) -> Judged | messages.Refusal | messages.EvalReport | None:
        """A readable answer: replay, freshness, then for an update its tensors, weight, steps, the
        weight's note and, when the hard bound needed it, the delta's norm (the fold reuses it).
        None for a resend of an accepted update (open round or closed: it is answered with its
        verdict, and never folded twice). Raises Rejected."""
        key = (device, answer.round, answer.attempt)
        if key in self.accepted:
            if self.accepted[key] == hashlib.sha256(data).hexdigest():
                log.info("update from %s for round %d (attempt %d) arrived again; receipt re-sent%s",
                         device, answer.round, answer.attempt,
                         "" if self.freshness.still_open(current, answer.round, answer.attempt) else " (its round is over)")
                return None
            raise Rejected("replay", f"{device} already had an update accepted for round {answer.round} "
                                     f"(attempt {answer.attempt})")
        self.freshness.check(current, device, answer, arrived)
        if isinstance(answer, messages.Refusal):
            return answer
        assert current is not None  # _check_fresh rejects an answer when no round is open
        if isinstance(answer, messages.EvalReport) != (not current.train):
            asked = "an update" if current.train else "an evaluation report (evaluation-only round)"
            raise Rejected("schema", f"round {current.number} asked {device} for {asked}")
        if isinstance(answer, messages.EvalReport):
            if answer.metric != self.terms.objective.metric:
                raise Rejected("schema", f"evaluation report measures {answer.metric!r}; this federation's "
                                         f"metric is {self.terms.objective.metric!r}")
            return answer
        released = self.released_sha.get(answer.model_version)
        reported = answer.metrics.get("model_sha")
        if released and isinstance(reported, str) and reported and not released.startswith(reported):
            raise Rejected("wrong_base", f"update was trained on model {reported[:16]}, but version "
                                         f"{answer.model_version} is {released[:16]} (a model of an earlier run?)")
        if answer.codec != codec.parse(self.terms.settings.codec).name:
            raise Rejected("codec", f"update uses codec {answer.codec!r}, the task asked for {self.terms.settings.codec!r}")
        delta = codec.decode(answer.codec, answer.specs, answer.body, {**self.terms.specs, **self.terms.extra_specs},
                             self.terms.max_values)
        bound, norm = self.terms.settings.max_update_norm, None
        if bound and (norm := l2_norm(sparse_only(delta, self.terms.specs))) > bound:
            raise Rejected("norm", f"update norm {norm:.4g} exceeds the bound {bound:.4g}")
        return (delta, *self._weight_and_steps(device, answer), norm)
