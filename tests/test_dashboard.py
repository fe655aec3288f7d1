"""The coordinator's dashboard on its metrics port: a running coordinator (real Mosquitto, three real
agents) serves the page, /fleet.json and /metrics; Debian's headless Chromium renders the page (its
script draws the fleet from /fleet.json) and takes a screenshot. Every wait is for a condition."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from broker_coordinator.access.broker import free_port
from broker_coordinator.simulation.processes import stop_processes

from .test_tasks_e2e import federation  # noqa: F401 - the fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.headers.get("Content-Type", ""), answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()
    except OSError:
        return 0, "", b""


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--hide-scrollbars", "--virtual-time-budget=8000", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_the_dashboard_shows_the_fleet_and_the_rounds(federation, tmp_path):  # noqa: F811
    port = free_port()
    coordinator = federation.start(tmp_path / "coordinator.log", EDGEFL_COORDINATOR_METRICS_PORT=str(port),
                                   EDGEFL_COORDINATOR_PACING_INTERVAL="1h")  # round 1, then it waits, its page up
    try:
        give_up = time.monotonic() + 120
        while True:
            status, kind, body = get(port, "/fleet.json")
            fleet = json.loads(body) if status == 200 else {}
            if fleet.get("rounds") and sum(d["state"] == "online" for d in fleet["devices"]) == 3:
                break
            assert time.monotonic() < give_up and coordinator.poll() is None, \
                (status, body[:500], (tmp_path / "coordinator.log").read_text()[-2000:])
            time.sleep(0.3)
        assert kind == "application/json" and fleet["federation"] == "field"
        devices = {d["device"]: d for d in fleet["devices"]}
        assert set(devices) == {"pi-01", "pi-02", "pi-03"}
        assert all(d["eligible"] and d["rounds"] >= 1 and d["last_verdict"] == "folded" for d in devices.values())
        assert all(d["version"] != "unknown" for d in devices.values())  # each agent says its release
        first = fleet["rounds"][0]
        assert first["round"] == 1 and first["participants"] == 3 and first["score"] is not None
        status, kind, page = get(port, "/")
        assert status == 200 and kind.startswith("text/html") and b"fleet.json" in page
        assert not re.search(rb"""(src|href)=["']?(https?:)?//|@import|url\(""", page)  # no external assets
        status, kind, metrics = get(port, "/metrics")
        assert status == 200 and b'edgefl_device_online{device="pi-01"} 1.0' in metrics
        assert get(port, "/nothing")[0] == 404

        if CHROMIUM is None:
            pytest.skip("Debian's chromium is not installed (.ci/run installs it): the page is not rendered")
        dom = chromium("--dump-dom", f"http://127.0.0.1:{port}/")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert 'data-ready="1"' in dom.stdout, dom.stdout[-3000:]  # the script ran and drew the fleet
        for device in devices:
            assert f"<td>{device}</td>" in dom.stdout
        assert "3 online of 3, 3 may train now" in dom.stdout and "<polyline" in dom.stdout
        shot = tmp_path / "dashboard.png"
        taken = chromium(f"--screenshot={shot}", "--window-size=1200,800", f"http://127.0.0.1:{port}/")
        assert taken.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", taken.stderr[-2000:]
        assert shot.stat().st_size > 10_000  # a drawn page, not a blank one
    finally:
        stop_processes([coordinator], timeout=60)


def test_the_rounds_show_the_privacy_budget_each_one_had_spent(tmp_path):
    """The store keeps each round's epsilon ([privacy] mode = "central"), which the privacy chart draws."""
    from broker_coordinator.engine.fleet_view import fleet_snapshot
    from broker_coordinator.storage.store import Store
    from edgefl_protocol.protocol import SPOKEN
    store = Store(tmp_path)
    for round_no, privacy in ((1, {"epsilon": 0.5, "delta": 1e-5}), (2, {"epsilon": 0.8, "delta": 1e-5}), (3, {})):
        store.record_round({"round": round_no, "attempt": 1, "closed": "complete", "selected": 3, "participants": 3,
                            "accuracy": 0.5, "loss": 1.0, "bytes_up": 100, "seconds": 1.0, "rejected": {},
                            "metric": "accuracy", "score": 0.5, "privacy": privacy})
    store.close()
    rounds = fleet_snapshot(tmp_path, "orchard", SPOKEN)["rounds"]
    assert [r["epsilon"] for r in rounds] == [0.5, 0.8, None]
