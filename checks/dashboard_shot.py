"""The dashboard screenshot in docs/OPERATOR.md: `python -m checks.dashboard_shot`.

A simulated fleet (the demo's mix on digits, `simulate --metrics-port`) trains; once 12 rounds are
in, Debian's headless Chromium renders the dashboard and writes docs/images/dashboard.png."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from broker_coordinator.access.broker import free_port
from broker_coordinator.simulation.processes import stop_processes

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "images" / "dashboard.png"
ROUNDS = 12


def rounds(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/fleet.json", timeout=5) as answer:
            fleet = json.load(answer)
    except (OSError, ValueError):
        return 0
    return sum(r["closed"] in ("complete", "deadline") for r in fleet.get("rounds", []))


def main() -> int:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("needs Debian's chromium: sudo apt-get install -y chromium", file=sys.stderr)
        return 2
    port = free_port()
    with tempfile.TemporaryDirectory() as work:
        simulate = subprocess.Popen([sys.executable, "-m", "broker_coordinator", "simulate", "--dataset", "digits",
                                     "--agents", "10", "--fleet", "zero2w:2,pi3:2,pi4:4,pi5:2", "--rounds", "40",
                                     "--round-timeout", "6", "--federation", "greenhouse", "--metrics-port", str(port),
                                     "--out", work], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            give_up = time.monotonic() + 600
            while rounds(port) < ROUNDS:
                if simulate.poll() is not None or time.monotonic() > give_up:
                    print(f"the simulation ended or stalled before round {ROUNDS}", file=sys.stderr)
                    return 1
                time.sleep(1)
            OUT.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                   "--virtual-time-budget=8000", "--window-size=1200,860", f"--screenshot={OUT}",
                                   f"http://127.0.0.1:{port}/"], capture_output=True, text=True, timeout=120)
        finally:
            stop_processes([simulate], timeout=30)
    print(f"wrote {OUT}" if done.returncode == 0 else done.stderr[-2000:])
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
