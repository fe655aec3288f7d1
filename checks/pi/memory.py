"""Resident memory of an emulated (qemu-user) process, with qemu's own share taken out.

Sampled from the host's /proc/PID/smaps. qemu-user (Debian bookworm's 7.2)
runs a 64-bit aarch64 guest with guest_base 0: the guest's own mappings (its
binary at 0x400000, its libraries, heap, stack and anonymous memory from
0x5500000000 up) lie below 1 TiB, while qemu's own (its static binary, its
malloc heap near 0x5555_0000_0000, the translated-code buffer and its other
mmaps near 0x7f00_0000_0000) lie far above. So qemu's share of a sample is the
RSS of the mappings that start at or above GUEST_LIMIT; the guest's is the rest,
what the same process would hold on a real Pi (page sizes aside).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

GUEST_LIMIT = 1 << 40
METHOD = ("peak over 0.2 s samples of the emulated process's /proc/PID/smaps on the host: RSS of mappings below "
          "1 TiB (the guest's own: qemu-user 7.2 maps a 64-bit guest with guest_base 0 from 0x5500000000 up) is "
          "reported; mappings above (qemu's static binary, its malloc heap, translated-code buffer and other host "
          "mmaps) are qemu's own share, measured in the same sample and subtracted")
HEADER = re.compile(r"^([0-9a-f]+)-[0-9a-f]+ ")


def sample(pid: int) -> tuple[int, int] | None:
    """(guest RSS, qemu RSS) in bytes, or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except (OSError, ProcessLookupError):
        return None
    guest = qemu = 0
    start = 0
    for line in text.splitlines():
        match = HEADER.match(line)
        if match:
            start = int(match.group(1), 16)
        elif line.startswith("Rss:"):
            kb = int(line.split()[1]) * 1024
            if start >= GUEST_LIMIT:
                qemu += kb
            else:
                guest += kb
    return guest, qemu


class PeakRss(threading.Thread):
    """Samples one process until it exits or `stop()`; peaks in MiB."""

    def __init__(self, pid: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.guest = self.qemu_at_peak = self.total = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            reading = sample(self.pid)
            if reading is None:
                break
            guest, qemu = reading
            self.samples += 1
            self.total = max(self.total, guest + qemu)
            if guest > self.guest:
                self.guest, self.qemu_at_peak = guest, qemu
            self.done.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.join(timeout=5)
        mib = 2**20
        return {"guest_mb": round(self.guest / mib, 1), "qemu_mb_at_peak": round(self.qemu_at_peak / mib, 1),
                "host_view_peak_mb": round(self.total / mib, 1), "samples": self.samples}
