"""What a round leaves behind: its record (participants, verdicts on each update, scores, bytes) and
what the fold did to each update. It reads the closed round and the fold's report, and logs and
counts the fold's verdicts on the way; a topology adds its own (`tree`: counts of devices, not of
partials)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from broker_coordinator.aggregation.consensus import Consensus
from broker_coordinator.aggregation.fold import MEDIAN, FoldReport
from broker_coordinator.engine.private_rounds import PrivateRounds
from broker_coordinator.engine.verdicts import Verdicts
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.engine.rounds import Round
from broker_coordinator.reporting.evaluation import federated_score
from broker_coordinator.settings.choices import AGREEMENT_WINDOW
from broker_coordinator.settings.round_settings import RoundRecord
from edgefl_models.objectives import Evaluation, Objective

log = logging.getLogger("broker_coordinator")


def record_row(record: RoundRecord) -> dict[str, Any]:
    """The record as a dict, shallow: `dataclasses.asdict` deep-copies every device's metrics, which
    at 300 updates a round cost the coordinator about 0.5 ms of CPU per update (bench/runtime.py's
    intake profile); the row is only serialized, never changed."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


class RoundRecords:
    def __init__(self, metrics: Metrics, verdicts: Verdicts, consensus: Consensus, objective: Objective,
                 privacy: PrivateRounds | None) -> None:
        self.metrics, self.verdicts, self.consensus = metrics, verdicts, consensus
        self.objective, self.privacy = objective, privacy
        self._said_unscored = False  # warned that devices asked to evaluate reported no score (once a process)
        self.excluded: set[str] = set()  # devices whose standing is at the floor, each said once at WARNING

    def say_excluded(self, round_no: int, device: str, share: float, why: str, at_floor: bool) -> None:
        """A down-weighted update is routine (its verdict and the record say it); a device whose standing
        is at the floor is all but excluded, which the operator hears once, at WARNING."""
        if not at_floor:
            self.excluded.discard(device)
        elif device not in self.excluded:
            self.excluded.add(device)
            log.warning("round %d: %s now weighs %.2f of its claim, the least a device keeps (%s); it regains "
                        "weight as its updates agree with their rounds again (the dashboard shows its verdicts)",
                        round_no, device, share, why)

    def published(self, record: RoundRecord, central: Evaluation | None, devices_evaluate: bool) -> None:
        """Prometheus, and the one warning a federation that measures nothing deserves."""
        self.metrics.rounds.labels(record.closed).inc()
        self.metrics.round_seconds.observe(record.seconds)
        if self.privacy:
            self.metrics.privacy_epsilon.set(self.privacy.spent)
        if central is not None:
            self.metrics.score.labels(central.metric, "central").set(central.score)
            self.metrics.loss.set(central.loss)
            if self.objective.task == "classification":
                self.metrics.accuracy.set(central.score)
        if record.federated:
            self.metrics.score.labels(record.federated["metric"], "devices").set(record.federated["score"])
        elif central is None and devices_evaluate and record.participants and not self._said_unscored:
            self._said_unscored = True  # every such round would say the same
            log.warning("round %d: the devices were asked to evaluate and none reported a score, so no "
                        "accuracy is measured; an agent evaluates on the data it holds out ([data] holdout = 0.2 "
                        "in its agent.toml: the [device] data shorthand that `edge-agent enroll` writes holds out "
                        "none), or give this coordinator a test set ([federation] test_data)", record.round)
        self.metrics.round.set(record.round)
        self.metrics.last_round_time.set(time.time())
        for device, entry in record.devices.items():
            if entry.get("verdict") in ("folded", "clipped", "left_out"):
                self.metrics.device_updates.labels(device, entry["verdict"]).inc()

    def record(self, rnd: Round, base_sha: str, model_sha: str, closed: str,
               central: Evaluation | None = None) -> RoundRecord:
        report = rnd.aggregate.report()
        clipped = {"norm": len(report.clipped)} if report.clipped else {}
        # bounding or down-weighting an update is routine (the record and the device's verdict say it):
        # only an update left out reaches the log at WARNING
        for device, (norm, bound) in report.clipped.items():
            log.debug("round %d: update from %s clipped from norm %.4g to %.4g", rnd.number, device, norm, bound)
            self.metrics.bounded.labels("norm").inc()
        for device, (distance, radius) in report.centered.items():
            log.debug("round %d: update from %s clipped towards the centre from distance %.4g to %.4g",
                      rnd.number, device, distance, radius)
            self.metrics.bounded.labels("center").inc()
            rnd.device_metrics.setdefault(device, {})["clipped_center"] = f"{distance:.4g} -> {radius:.4g}"
        if report.centered:
            clipped["center"] = len(report.centered)
        if rnd.weights_clipped:
            clipped["weight"] = rnd.weights_clipped
        for device, cosine in report.disagreeing.items():
            standing = self.consensus.of(device)
            log.info("round %d: update from %s points away from its round (median cosine %.3f with the "
                     "others): %s", rnd.number, device, cosine,
                     f"its weight from its next update on is {standing:.2f} of its claim" if standing < 1 else
                     f"noted; its weight falls at {self.consensus.flags_to_act} flags in its last "
                     f"{AGREEMENT_WINDOW} judged updates")
            self.metrics.bounded.labels("disagreed").inc()
            rnd.device_metrics.setdefault(device, {})["disagreed"] = f"median cosine {cosine:.3f}"
        if report.disagreeing:
            clipped["disagreed"] = len(report.disagreeing)
        kin = self.consensus.kin if report.judged_kin else {}
        for device, (closest, cosine) in kin.items():
            log.info("round %d: updates from %s depart from their rounds like %s's (path cosine %.3f): its "
                        "weight from its next update on is %.2f of its claim", rnd.number, device, closest,
                        cosine, self.consensus.of(device))
            self.metrics.bounded.labels("kin").inc()
            rnd.device_metrics.setdefault(device, {})["kin"] = f"{closest} (path cosine {cosine:.3f})"
        if kin:
            clipped["kin"] = len(kin)
        for device, scale in report.held_back.items():
            log.info("round %d: update from %s folded at %.2f of its weight: its partial sum holds an update "
                        "this round flagged (verdict_banks)", rnd.number, device, scale)
            self.metrics.bounded.labels("held_back").inc()
            rnd.device_metrics.setdefault(device, {})["held_back"] = f"{scale:.2f}"
        if report.held_back:
            clipped["held_back"] = len(report.held_back)
        for device, (share, why) in report.discounted.items():  # below full weight for earlier rounds' flags
            self.metrics.bounded.labels("reduced_weight").inc()
            rnd.device_metrics.setdefault(device, {})["weight_share"] = f"{share:.2f} ({why})"
            self.say_excluded(rnd.number, device, share, why, device in report.floored)
        if report.discounted:
            clipped["reduced_weight"] = len(report.discounted)
        for device, cosine in report.gated.items():  # the root update leaves out honest skewed data routinely
            log.log(logging.WARNING if report.gated_by == MEDIAN else logging.INFO, "round %d: update from %s "
                    "left out: it points away from %s (cosine %.2f)", rnd.number, device, report.gated_by, cosine)
            self.metrics.bounded.labels("direction").inc()
            rnd.device_metrics.setdefault(device, {})["left_out"] = f"direction (cosine {cosine:.2f})"
        for device, (norm, bound) in report.clipped.items():
            rnd.device_metrics.setdefault(device, {})["clipped_norm"] = f"{norm:.4g} -> {bound:.4g}"
        if report.gated:
            clipped["direction"] = len(report.gated)
        left_out = self.left_out(rnd, report, closed)
        unvoted = report.unvoted
        if unvoted is not None:
            self.metrics.unvoted.set(unvoted)
            log.debug("round %d: the sign votes held %.1f%% of the parameters still", rnd.number, 100 * unvoted)
        score = central.score if central else float("nan")
        accuracy = score if self.objective.task == "classification" else float("nan")
        # the devices' score describes one model: the newest version the round's reports measured
        version = max(rnd.evaluated.values(), default=rnd.base_version)
        reports = {d: r for d, r in rnd.evaluations.items() if rnd.evaluated.get(d, version) == version}
        federated = federated_score(self.objective.metric, reports, version)
        return RoundRecord(rnd.number, rnd.attempt, rnd.counted, len(rnd.cohort), accuracy,
                           central.loss if central else float("nan"), rnd.bytes_up, time.time() - rnd.started,
                           dict(rnd.rejected), closed, base_sha, model_sha, rnd.device_metrics, clipped,
                           dict(rnd.refused), rnd.reason, self.objective.metric, score, federated,
                           "train" if rnd.train else "evaluate", _bytes_down(rnd.device_metrics), left_out=left_out,
                           privacy=self.privacy.summary() if self.privacy else {},
                           unvoted=unvoted)

    def left_out(self, rnd: Round, report: FoldReport, closed: str) -> float:
        """The fraction of the round's accepted updates the fold left out (an abandoned attempt folded
        none), also a Prometheus gauge; each device's verdict goes into its entry of the record."""
        count = report.count if rnd.train else 0
        left = count if closed == "abandoned" else len(report.gated)
        fraction = left / count if count else 0.0
        self.metrics.left_out.set(fraction)
        for device, metrics in rnd.device_metrics.items():
            verdict = self.verdicts.of((device, rnd.number, rnd.attempt))
            if verdict is not None and verdict.kind:
                metrics["verdict"] = verdict.kind
        return fraction


def _bytes_down(device_metrics: Mapping[str, Mapping[str, Any]]) -> int:
    """Model bytes the round's participants say they received (a measurement, trusted for nothing)."""
    values = (m.get("bytes_down") for m in device_metrics.values())
    return sum(int(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 2**40)
