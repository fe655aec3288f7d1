"""The one exception the protocol raises for hostile or malformed input."""

from __future__ import annotations


class Rejected(Exception):
    """A message that must not be acted on.

    `reason` is a short stable token (used as a metric label and in tests);
    `detail` is the sentence a person reads in the log.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
