"""Watching a fleet with Prometheus: the alert rules in deploy/prometheus pass Debian's `promtool`
(their syntax, and unit tests of when each alert fires), and Debian's `prometheus` server scrapes a
running coordinator (real Mosquitto, real agents) and reads its per-device series while the rules
load. Every wait is for a condition."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from broker_coordinator.access.broker import free_port, wait_for_port
from broker_coordinator.simulation.processes import stop_processes

from .operator_fixtures import PROJECT_ROOT
from .test_tasks_e2e import federation  # noqa: F401 - the fixture

DEPLOY = PROJECT_ROOT / "deploy" / "prometheus"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                      reason="Debian's prometheus package is not installed (.ci/run installs it)")


@needs_prometheus
def test_the_alert_rules_pass_promtool_and_their_unit_tests():
    checked = subprocess.run([PROMTOOL, "check", "rules", "edgefl-rules.yml"], cwd=DEPLOY, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS: 6 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = subprocess.run([PROMTOOL, "test", "rules", "edgefl-rules.test.yml"], cwd=DEPLOY, capture_output=True,
                            text=True, timeout=60)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    config = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=DEPLOY, capture_output=True,
                            text=True, timeout=60)
    assert config.returncode == 0, config.stdout + config.stderr


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return json.load(answer)["data"]["result"]
    except OSError:
        return []


@needs_prometheus
def test_prometheus_scrapes_a_running_coordinator_and_its_devices(federation, tmp_path):  # noqa: F811
    metrics_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    shutil.copy(DEPLOY / "edgefl-rules.yml", tmp_path / "edgefl-rules.yml")
    config.write_text((DEPLOY / "prometheus.yml").read_text().replace("15s", "1s")
                      .replace("127.0.0.1:9108", f"127.0.0.1:{metrics_port}"))
    coordinator = federation.start(tmp_path / "coordinator.log", EDGEFL_COORDINATOR_METRICS_PORT=str(metrics_port),
                                   EDGEFL_COORDINATOR_PACING_INTERVAL="1h")  # round 1, then it waits, metrics up
    with open(tmp_path / "prometheus.log", "wb") as out:
        prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{web_port}"], stdout=out,
                                      stderr=subprocess.STDOUT)
    try:
        wait_for_port(web_port, prometheus, tmp_path / "prometheus.log", timeout=60)
        give_up = time.monotonic() + 120
        wanted = {'edgefl_round{job="edgefl"} >= 1': 1,
                  'edgefl_device_online{job="edgefl"} == 1': 3,
                  'edgefl_device_eligible{job="edgefl"} == 1': 3,
                  'edgefl_device_updates_total{job="edgefl", outcome="folded"} >= 1': 3,
                  'edgefl_last_round_timestamp_seconds{job="edgefl"} > 0': 1}
        while not all(len(query(web_port, expr)) == n for expr, n in wanted.items()):
            assert time.monotonic() < give_up and coordinator.poll() is None, \
                ({expr: query(web_port, expr) for expr in wanted}, (tmp_path / "coordinator.log").read_text()[-2000:])
            time.sleep(0.5)
        devices = {r["metric"]["device"] for r in query(web_port, 'edgefl_device_online{job="edgefl"}')}
        assert devices == {"pi-01", "pi-02", "pi-03"}
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/api/v1/rules", timeout=5) as answer:
            rules = [r for g in json.load(answer)["data"]["groups"] for r in g["rules"]]
        assert len(rules) == 6 and all(r["health"] == "ok" for r in rules), rules
        firing = query(web_port, 'ALERTS{alertstate="firing"}')
        assert firing == [], firing  # a healthy federation raises nothing
    finally:
        stop_processes([prometheus, coordinator], timeout=60)
