"""memory.PeakRss, plus the guest's own files that qemu-user maps above 1 TiB.

memory.py counts as the guest's the mappings below 1 TiB and as qemu's all above. With Debian
bookworm's qemu-user 7.2 that is not the whole guest: the guest's ld.so maps the big shared libraries
(libtorch_cpu.so, libtorch_python.so) at 0x7f..., above 1 TiB. Compared with the guest's own
/proc/self/maps (qemu-user shows a guest only its own mappings), after `import torch` and one conv
step on cortex-a53: 174 MB below 1 TiB, all guest-visible; 94 MB of guest-visible mappings above it,
all of them files of the root (libtorch_cpu.so 71 MB, libtorch_python.so 9 MB, ...); 161 MB above
it that the guest does not see (qemu's own). qemu-user-static is a static binary and maps no file of
the root for itself, so a file-backed mapping whose path lies in the root is the guest's wherever it
lies: below 1 TiB plus those files gave 267 MB against the guest's own view of 268 MB.

GuestRss reports PeakRss's keys unchanged (guest_mb: below 1 TiB only, comparable with earlier
results) and adds guest_incl_root_files_mb, the peak of (below 1 TiB + the root's files above it),
with the root files' share and qemu's remaining share in that same sample.
"""

from __future__ import annotations

import re
from pathlib import Path

from .memory import GUEST_LIMIT, PeakRss

HEADER = re.compile(r"^([0-9a-f]+)-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")
METHOD_ADDED = ("guest_incl_root_files_mb adds to guest_mb the RSS of the mappings above 1 TiB whose file lies in the "
                "arm64 root (the guest's shared libraries, e.g. libtorch_cpu.so, which qemu-user 7.2 maps at 0x7f...: "
                "memory.py counts them as qemu's); checked against the guest's own /proc/self/maps (267 vs 268 MB "
                "after import torch): checks/pi/guest_memory.py")


def sample(pid: int, root_prefix: str) -> tuple[int, int, int] | None:
    """(RSS below 1 TiB, RSS above, RSS above in files under root_prefix) in bytes; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except (OSError, ProcessLookupError):
        return None
    below = above = files_above = 0
    start, in_root = 0, False
    for line in text.splitlines():
        match = HEADER.match(line)
        if match:
            start, in_root = int(match.group(1), 16), match.group(2).startswith(root_prefix)
        elif line.startswith("Rss:"):
            size = int(line.split()[1]) * 1024
            if start < GUEST_LIMIT:
                below += size
            else:
                above += size
                if in_root:
                    files_above += size
    return below, above, files_above


class GuestRss(PeakRss):
    """PeakRss of one emulated process in `root`, with the root's files above 1 TiB counted apart."""

    def __init__(self, pid: int, root: Path | str, interval: float = 0.2):
        super().__init__(pid, interval)
        self.prefix = str(Path(root).resolve()).rstrip("/") + "/"
        self.full = self.files_at_full = self.qemu_at_full = 0

    def run(self) -> None:
        while not self.done.is_set():
            reading = sample(self.pid, self.prefix)
            if reading is None:
                break
            below, above, files_above = reading
            self.samples += 1
            self.total = max(self.total, below + above)
            if below > self.guest:
                self.guest, self.qemu_at_peak = below, above
            if below + files_above > self.full:
                self.full, self.files_at_full, self.qemu_at_full = below + files_above, files_above, above - files_above
            self.done.wait(self.interval)

    def stop(self) -> dict[str, float]:
        out = super().stop()
        mib = 2**20
        out.update(guest_incl_root_files_mb=round(self.full / mib, 1),
                   root_files_above_1tib_mb=round(self.files_at_full / mib, 1),
                   qemu_own_mb_at_that_peak=round(self.qemu_at_full / mib, 1))
        return out
