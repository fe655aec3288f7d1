"""What a device commits after sending an update: only what the coordinator folded, as it folded it.

The coordinator's receipt carries the fold's verdict (`edgefl_protocol.messages.Receipt`), and the
device settles its two pieces of state the server mirrors, the algorithm's state (FedDyn's and
DynSAM's dual h_k, via `ClientRule.committed`) and the codec's error-feedback residual:

    folded        commit the delta as the server decoded it; residual: what top-k did not send
    clipped (s)   commit s x the decoded delta (s: the scale the receipt reports; for centered
                  clipping the projection of what was folded on what was sent, the best the
                  device can do without the centre); residual: what top-k did not send. The
                  clipped-away part is not owed: resending it would undo the bound.
    left_out      the dual stays as it was; residual: what top-k did not send. What was sent
                  was judged and refused: it is neither committed nor resent (owing it would
                  send the refused delta again, and grow the residual round after round).
    rejected      the coordinator never folded it: the dual stays, and the whole delta is owed
                  (folded into the residual, `owed`) and named in the next update's `owed`
                  metric, so the coordinator can tell if it had folded it after all. A
                  rejection of a *resend* counts only when the coordinator vouches for it
                  (`not_folded`: it still remembers the round); otherwise it is unknown.
    unknown       no receipt, or the verdict is pending: the safe side. The dual stays (nothing
                  is committed that the device cannot show was folded) and the residual is what
                  top-k did not send (nothing sent is ever sent twice). The signed payload is
                  kept; before the next training task the agent resends it, and the coordinator
                  answers an identical resend with its verdict (within its replay window), so
                  the device settles then. If no verdict comes within `SETTLE_WAIT`, or the new
                  task is `SETTLE_ROUNDS` rounds later, it gives up on the safe side: the
                  update may be lost, never counted twice. The payload lives in memory only: a
                  restarted agent has given up.

Exactly one of the two counts: the update once folded, or its delta owed in the next one.

A verdict given at arrival can be overtaken: a streaming fold says "folded" as the update comes in,
and if the round is then abandoned (its quorum not met, or no version made of it) the coordinator
sends a second receipt, `left_out`. Before its next training the agent looks for one about the
update it last committed, and if it is there settles that update again as left out: the state goes
back to what it was before (nothing newer has been committed on top of it yet).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from edgefl_protocol import codec, messages
from edgefl_protocol.algorithms.base import EXTRA_PREFIX

from .delivery import SETTLE_WAIT, Delivery
from .model_fetch import MAX_MODEL_VALUES
from .state import DeviceState

log = logging.getLogger("edge_agent")
SETTLE_ROUNDS = 5  # an unsettled update older than this many rounds is given up (the coordinator's window is 10)
MAX_CLAIMS = 8  # earlier updates the residual is said to carry (the `owed` metric)


def owed(delta: dict, residual: dict | None) -> dict:
    """Error feedback after an update the coordinator never folded: the old residual plus the whole
    delta (model tensors only; `extra.*` state is resent afresh next round)."""
    residual = residual or {}
    return {name: value + residual[name] if name in residual and residual[name].shape == value.shape else value
            for name, value in delta.items() if not name.startswith(EXTRA_PREFIX)}


@dataclass
class Sent:
    """One update as it went out, with what the device needs to settle it."""

    task: messages.Task
    payload: bytes
    algorithm: str
    rule: Any  # the algorithm's client rule, as training left it
    before: dict  # the algorithm's state before the round
    delta: dict[str, np.ndarray]  # the local float32 delta
    encoded: codec.Encoded
    old_residual: dict | None
    down: dict[str, int]  # downlink bytes the update reported
    claims: list[str] = field(default_factory=list)  # the owed updates its residual carried

    @property
    def key(self) -> tuple[int, int]:
        return self.task.round, self.task.attempt

    def decoded(self) -> dict[str, np.ndarray]:
        """The delta as the server decodes it."""
        if codec.parse(self.encoded.codec).lossless:
            return self.delta
        return codec.decode(self.encoded.codec, self.encoded.specs, self.encoded.body, None, MAX_MODEL_VALUES)


def verdict_of(receipt: messages.Receipt | None, resend: bool = False) -> tuple[str, float, str]:
    """(folded | clipped | left_out | rejected | unknown, scale, detail) of a receipt."""
    if receipt is None:
        return "unknown", 0.0, "no receipt"
    if receipt.accepted:
        kind = receipt.verdict or "folded"  # a coordinator from before verdicts: folded as sent
        if kind not in ("folded", "clipped", "left_out"):
            return "unknown", 0.0, receipt.detail or kind
        return kind, receipt.scale if kind == "clipped" else (0.0 if kind == "left_out" else 1.0), receipt.detail
    if resend and receipt.verdict != "not_folded":
        return "unknown", 0.0, f"{receipt.reason}: {receipt.detail} (the coordinator no longer knows the round)"
    return "rejected", 0.0, f"{receipt.reason}: {receipt.detail}"


def apply_verdict(data: dict[str, Any], sent: Sent, kind: str, scale: float = 1.0) -> None:
    """Settle `sent` in the device state `data` by the verdict `kind` (see the module's docstring):
    the algorithm's section and the codec's (`residual`, `owed`)."""
    ef = data.setdefault("codec", {})
    claims = [c for c in ef.get("owed", []) if c not in sent.claims]
    data[sent.algorithm] = sent.before
    ef["residual"] = sent.encoded.residual
    if kind in ("folded", "clipped"):
        decoded = sent.decoded()
        sent.rule.committed(decoded if scale == 1.0 else {n: a * np.float32(scale) for n, a in decoded.items()})
        data[sent.algorithm] = sent.rule.state
    elif kind == "rejected" and sent.encoded.residual is not None:
        ef["residual"] = owed(sent.delta, sent.old_residual)
        claims = (ef.get("owed", []) + [f"{sent.task.round}.{sent.task.attempt}"])[-MAX_CLAIMS:]
        # a retry of this round from the same model retrains this delta: then it is owed no more
        ef["retry"] = {"round": sent.task.round, "version": sent.task.model_version,
                       "claim": f"{sent.task.round}.{sent.task.attempt}", "residual": sent.old_residual or {}}
    elif kind == "unknown":
        claims = ef.get("owed", [])  # kept until the update is settled
    ef["owed"] = claims
    if kind != "rejected":
        ef.pop("retry", None)
    for name in ("residual", "owed"):
        if not ef.get(name):
            ef.pop(name, None)


class Settlement:
    """Settles the updates sent: commits in `state` what the coordinator folded; asks `delivery` for a
    verdict still missing (resending the update); `give_back(down)` returns the downlink byte counts a
    rejected update reported, so the next one reports them again."""

    def __init__(self, state: DeviceState, delivery: Delivery, give_back: Callable[[dict[str, int]], None]) -> None:
        self.state, self.delivery, self.give_back = state, delivery, give_back
        self.unsettled: Sent | None = None  # sent, its verdict not known yet: asked for before the next training
        self.committed: Sent | None = None  # the last update committed as folded or clipped, until the next training

    def settle(self, sent: Sent, receipt: messages.Receipt | None, resend: bool = False) -> str:
        """Commit what the verdict says was folded (see the module's docstring); returns the verdict."""
        kind, scale, detail = verdict_of(receipt, resend)
        apply_verdict(self.state.data, sent, kind, scale)
        # what `edge-agent status` shows: the last verdict and why (a reduced weight, a clip, a rejection)
        self.state.data["last_verdict"] = {"round": sent.task.round, "attempt": sent.task.attempt, "kind": kind,
                                           "detail": (detail or "")[:300]}
        if kind == "rejected":
            self.give_back(sent.down)
        self.unsettled = sent if kind == "unknown" else None
        self.committed = sent if kind in ("folded", "clipped") else None
        if kind == "unknown":
            log.info("round %d: the %supdate's verdict is not known yet (%s); nothing committed, nothing owed, "
                     "it is asked for again before the next task", sent.task.round, "resent " if resend else "",
                     detail)
        return kind

    def settle_unsettled(self, task: messages.Task) -> None:
        """Before training for `task`: undo a commit its round's abandonment overtook; resend the
        update still without a verdict (bounded wait), and settle it by the answer; give up on the
        safe side if none comes."""
        self._undo_if_abandoned()
        self._drop_retrained(task)
        sent, self.unsettled = self.unsettled, None
        if sent is None:
            return
        receipt = self.delivery.take(sent.key)  # a final verdict may have come meanwhile
        if receipt is not None and not (receipt.accepted and receipt.verdict == "pending"):
            kind = self.settle(sent, receipt)
        elif task.round - sent.task.round >= SETTLE_ROUNDS:
            kind = "unknown"
        else:
            ask = replace(sent.task, deadline=min(time.time() + SETTLE_WAIT, task.deadline))
            self.delivery.deliver(ask, sent.payload, "update (resent for its verdict)")
            kind = self.settle(sent, self.delivery.last_receipt, resend=True)
        if kind == "unknown":
            self.unsettled = None
            ef = self.state.section("codec")
            ef["owed"] = [c for c in ef.get("owed", []) if c not in sent.claims]
            if not ef["owed"]:
                ef.pop("owed")
            log.warning("round %d: gave up on the verdict for the round %d update: it may be lost, never "
                        "counted twice (its delta is not owed, nothing was committed)", task.round, sent.task.round)
        else:
            log.info("round %d: the round %d update settled: %s", task.round, sent.task.round, kind)
        self.state.save()

    def _drop_retrained(self, task: messages.Task) -> None:
        """A new attempt of the round whose update was rejected, from the same model, trains that delta
        again: sending the owed copy beside it would count it twice, so the residual goes back to what
        it was before that update."""
        ef = self.state.section("codec")
        retry = ef.get("retry")
        if not retry or (retry["round"], retry["version"]) != (task.round, task.model_version):
            return
        ef["residual"] = retry["residual"]
        ef["owed"] = [c for c in ef.get("owed", []) if c != retry["claim"]]
        for name in ("residual", "owed", "retry"):
            if not ef.get(name) or name == "retry":
                ef.pop(name, None)
        self.state.save()
        log.info("round %d (attempt %d): the delta owed for attempt %s is dropped: this attempt trains it again "
                 "from the same model", task.round, task.attempt, retry["claim"].split(".")[1])

    def _undo_if_abandoned(self) -> None:
        """Before training: if the update committed last was left out after all (a second receipt: its
        round was abandoned after the fold took it), settle it again as left out."""
        sent, self.committed = self.committed, None
        if sent is None:
            return
        later = self.delivery.take(sent.key)
        if later is None or not later.accepted or later.verdict != "left_out":
            return
        apply_verdict(self.state.data, sent, "left_out", 0.0)
        self.state.save()
        log.warning("round %d: the update committed as folded was left out after all (%s); its commit is "
                    "undone", sent.task.round, later.detail or "no reason given")
