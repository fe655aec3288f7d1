"""The verdicts a coordinator gave for a round it has not saved yet, written before each receipt.

A streaming fold tells a device "folded" as its update arrives; the round is saved (checkpoint,
then the database) only when it closes. A coordinator killed in between resumes from the last
saved round and runs the round again, while the devices have committed an update that is in no
model (their algorithm's dual, what top-k owed). So every verdict is appended here before its
receipt goes out (an `os.write`: it survives the process, not the machine), the journal is
emptied once its round is saved, and a restarted coordinator takes back the verdicts of rounds it
never saved: each device is told `left_out`, and its agent undoes the commit before it trains
again (`edge_agent/settlement.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

JOURNAL = "verdicts.journal"
COUNTED = ("folded", "clipped")  # verdicts a device commits on


class VerdictJournal:
    def __init__(self, state_dir: Path | str) -> None:
        self.path = Path(state_dir) / JOURNAL
        self._fd: int | None = None

    def given(self, round_no: int, attempt: int, device: str, verdict: str) -> None:
        """Before the receipt: (round, attempt, device) was told `verdict`."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(self._fd, f"{round_no} {attempt} {device} {verdict}\n".encode())

    def saved(self) -> None:
        """Its rounds are saved: nothing to take back any more."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)

    def unsaved(self, first_unsaved_round: int) -> list[tuple[int, int, str]]:
        """(round, attempt, device) of updates last told folded or clipped in rounds not saved."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        last: dict[tuple[int, int, str], str] = {}
        for line in lines:
            parts = line.split(" ")
            if len(parts) == 4 and parts[0].isdigit() and parts[1].isdigit():  # a torn last line is skipped
                last[(int(parts[0]), int(parts[1]), parts[2])] = parts[3]
        return sorted(key for key, verdict in last.items() if verdict in COUNTED and key[0] >= first_unsaved_round)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
