"""How an answer reaches the coordinator: publish, then wait for its receipt; resend while none comes.

A broker's acknowledgement is not delivery: the agent resends an update (or a report, or a refusal)
until the coordinator's receipt for that round and attempt arrives, or the deadline passes, and logs
the verdict either way. A `pending` receipt (accepted, the fold's verdict not decided yet) is
followed by a second one, which it waits for a while longer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from edgefl_protocol import messages

log = logging.getLogger("edge_agent")
RESEND_AFTER = 10.0  # seconds without a receipt before the update goes out again
SETTLE_WAIT = 30.0  # seconds the agent waits for a final verdict after the deadline or before its next task


class Delivery:
    """Sends to `topic` through `publish_until(topic, payload, deadline) -> acknowledged`; paho's thread
    hands it the coordinator's receipts (`receive`). A wait ends early when `stopping` is set or
    `superseded()` says a newer task has come (the coordinator moved on)."""

    def __init__(self, publish_until: Callable[[str, bytes, float], bool], topic: str,
                 stopping: threading.Event, superseded: Callable[[], bool]) -> None:
        self.publish_until, self.topic, self.stopping, self.superseded = publish_until, topic, stopping, superseded
        self.receipts: dict[tuple[int, int], messages.Receipt] = {}  # (round, attempt) -> the coordinator's verdict
        self.arrived = threading.Condition()
        self.last_receipt: messages.Receipt | None = None  # the receipt the last `deliver` settled on

    def receive(self, receipt: messages.Receipt) -> None:
        with self.arrived:
            self.receipts[(receipt.round, receipt.attempt)] = receipt
            self.arrived.notify_all()

    def wake(self) -> None:
        """A new task came: a delivery still waiting for its receipt looks again (it is superseded)."""
        with self.arrived:
            self.arrived.notify_all()

    def take(self, key: tuple[int, int]) -> messages.Receipt | None:
        with self.arrived:
            return self.receipts.pop(key, None)

    def deliver(self, task: messages.Task, payload: bytes, what: str) -> str:
        """Publish, then wait for the coordinator's receipt; resend while none comes, until the deadline.
        The log says what became of it, either way; so does the result: accepted, rejected, pending
        (accepted, the fold's final verdict not yet known), superseded (a newer task came first),
        no_receipt, or unsent; `last_receipt` is the receipt it settled on, if any."""
        key = (task.round, task.attempt)
        sends, self.last_receipt = 0, None
        while time.time() < task.deadline and not self.stopping.is_set():
            if not self.publish_until(self.topic, payload, task.deadline):
                break
            sends += 1
            resend_at = min(time.time() + RESEND_AFTER, task.deadline)
            with self.arrived:
                # short waits: a SIGTERM sets `stopping` without notifying anyone
                while not (key in self.receipts or self.stopping.is_set() or self.superseded()
                           or time.time() >= resend_at):
                    self.arrived.wait(min(0.5, max(0.0, resend_at - time.time())))
                receipt = self.receipts.pop(key, None)
                for old in [k for k in self.receipts if k[0] < task.round - 2]:
                    del self.receipts[old]
            if receipt is None and self.superseded():
                log.warning("round %d: a new task arrived before the receipt for the %s (sent %d times); "
                            "the coordinator moved on without it", task.round, what, sends)
                return "superseded"
            if receipt is None:
                log.info("round %d: no receipt for the %s yet; sending it again", task.round, what)
                continue
            if receipt.accepted and receipt.verdict == "pending":  # the final verdict follows: one line for both
                log.debug("round %d: %s accepted by the coordinator%s", task.round, what, describe(receipt))
                receipt = self._await_final(key, task.deadline + SETTLE_WAIT) or receipt
            self.last_receipt = receipt
            if receipt.accepted:
                log.log(logging.INFO if receipt.verdict != "left_out" else logging.WARNING,
                        "round %d: %s accepted by the coordinator%s%s", task.round, what, describe(receipt),
                        f" (sent {sends} times)" if sends > 1 else "")
                return "pending" if receipt.verdict == "pending" else "accepted"
            # too late or overtaken (a slow link, a coordinator restart) is routine; anything else is not
            log.log(logging.INFO if receipt.reason in ("stale", "late", "too_stale") else logging.WARNING,
                    "round %d: %s rejected by the coordinator: %s: %s", task.round, what, receipt.reason,
                    receipt.detail)
            return "rejected"
        if self.stopping.is_set():
            log.info("round %d: shutting down before the coordinator's receipt for the %s (sent %d times)",
                        task.round, what, sends)
            return "no_receipt"
        if sends == 0:
            log.warning("round %d: %s not delivered to the broker before the deadline; dropped", task.round, what)
            return "unsent"
        log.warning("round %d: no receipt for the %s before the deadline (sent %d times); the coordinator may "
                    "not have it", task.round, what, sends)
        return "no_receipt"

    def _await_final(self, key: tuple[int, int], until: float) -> messages.Receipt | None:
        """After a `pending` receipt: the second receipt, with the fold's final verdict, until `until`
        (or shutdown, or a newer task: then the update is settled before that task's training)."""
        with self.arrived:
            while time.time() < until and not self.stopping.is_set() and not self.superseded():
                receipt = self.receipts.get(key)
                if receipt is not None and receipt.verdict != "pending":
                    return self.receipts.pop(key)
                self.arrived.wait(min(0.5, max(0.0, until - time.time())))
        return None


def describe(receipt: messages.Receipt) -> str:
    """The verdict, for the agent's log line: e.g. ": clipped (norm 2.1 -> 1.5; effective scale 0.71)";
    "" for a receipt without one (an evaluation report, a coordinator from before verdicts)."""
    if not receipt.verdict:
        return ""
    names = {"left_out": "left out", "pending": "verdict pending"}
    return ": " + names.get(receipt.verdict, receipt.verdict) + (f" ({receipt.detail})" if receipt.detail else "")
