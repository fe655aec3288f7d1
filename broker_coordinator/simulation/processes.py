"""Stop exactly the child processes we started: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable


def stop_processes(processes: Iterable[subprocess.Popen], timeout: float = 15.0) -> None:
    processes = list(processes)
    for p in processes:
        if p.poll() is None:
            p.terminate()
    give_up = time.monotonic() + timeout
    for p in processes:
        try:
            p.wait(timeout=max(0.1, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
