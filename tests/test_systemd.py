"""The unit files in systemd/: they pass `systemd-analyze verify` with no warning, carry the hardening
and resource settings the operator guide promises, and `edge-agent install-service` renders them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from broker_coordinator.access.broker import render_fragment
from edge_agent import service

from .operator_fixtures import run_module

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (Debian package "
                                                         "'systemd'; CI installs it)")
HARDENING = ["ProtectSystem=strict", "ProtectHome=yes", "NoNewPrivileges=yes", "PrivateTmp=yes",
             "Restart=on-failure", "ConfigurationDirectory=edgefl"]


def directives(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def verify(tmp_path: Path, name: str, text: str) -> subprocess.CompletedProcess:
    unit = tmp_path / name
    unit.write_text(text)
    return subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60)


def coordinator_unit() -> str:
    # the shipped file names /opt/edgefl; point it at this interpreter, as an installation would
    text = (SYSTEMD / "broker-coordinator.service").read_text()
    return re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable} -m broker_coordinator", text, flags=re.M)


@needs_analyze
def test_agent_unit_passes_systemd_analyze_verify(tmp_path):
    text = service.render_unit(Path("/etc/edgefl/agent.toml"), "512M", command=f"{sys.executable} -m edge_agent")
    result = verify(tmp_path, "edge-agent.service", text)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stderr


@needs_analyze
def test_coordinator_unit_passes_systemd_analyze_verify(tmp_path):
    result = verify(tmp_path, "broker-coordinator.service", coordinator_unit())
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stderr


@needs_analyze
def test_verify_would_catch_a_broken_unit(tmp_path):
    text = service.render_unit(Path("/etc/edgefl/agent.toml"), command="/nonexistent/edge-agent")
    assert verify(tmp_path, "edge-agent.service", text).returncode != 0


def test_agent_unit_settings():
    d = directives((SYSTEMD / "edge-agent.service").read_text())
    for item in HARDENING:
        key, value = item.split("=")
        assert d[key] == [value], key
    assert d["DynamicUser"] == ["yes"] and d["StateDirectory"] == ["edgefl-agent"]
    assert d["RestartSec"] and d["Nice"] == ["10"] and d["CPUWeight"] and d["MemoryMax"]
    assert d["LoadCredential"] == ["agent.toml:/etc/edgefl/agent.toml"] and "%d/agent.toml" in d["ExecStart"][0]


def test_coordinator_unit_settings():
    d = directives((SYSTEMD / "broker-coordinator.service").read_text())
    for item in HARDENING:
        key, value = item.split("=")
        assert d[key] == [value], key
    assert d["User"] == ["edgefl"] and d["StateDirectory"] == ["edgefl-coordinator"]
    for key in ("After", "Wants"):
        assert {"network-online.target", "mosquitto.service"} <= set(d[key][0].split()), key


def default_fragment(tmp_path: Path) -> str:
    """What `broker-config` writes for a config that sets only the required keys."""
    from broker_coordinator.settings.config import load_config
    from broker_coordinator.access.devices import message_size_limit
    path = tmp_path / "coordinator.toml"
    path.write_text('[federation]\ntest_data = "test.npz"\n[broker]\npassword = "x"\n')
    config = load_config(path, with_rounds=False)
    b = config.broker
    return render_fragment(b.devices_port, Path(b.passwd_file), Path(b.acl_file), message_size_limit(config), b.bind,
                           local_port=b.port)


def test_shipped_mosquitto_fragment_is_what_broker_config_writes_by_default(tmp_path):
    assert (SYSTEMD / "mosquitto-edgefl.conf").read_text() == default_fragment(tmp_path)


# edge-agent install-service ---------------------------------------------------------------------
def test_install_service_dry_run_prints_the_unit_and_commands(tmp_path):
    result = run_module("edge_agent", "install-service", "--dry-run", "--memory-max", "384M",
                        "--config", str(tmp_path / "agent.toml"))
    assert result.returncode == 0, result.stderr
    assert "MemoryMax=384M" in result.stdout and f"LoadCredential=agent.toml:{tmp_path}/agent.toml" in result.stdout
    assert "systemctl enable --now edge-agent.service" in result.stdout
    assert not Path("/etc/systemd/system/edge-agent.service.dryrun").exists()


def test_install_service_without_root_prints_the_commands(monkeypatch, tmp_path):
    monkeypatch.setattr(service.os, "geteuid", lambda: 1000)
    code, text = service.install(tmp_path / "agent.toml", "70%", dry_run=False, dest=tmp_path / "unit")
    assert code == 1 and "needs root" in text and "sudo systemctl enable --now" in text
    assert not (tmp_path / "unit").exists()


def test_install_service_bad_memory_is_one_line(tmp_path):
    result = run_module("edge_agent", "install-service", "--dry-run", "--memory-max", "lots")
    assert result.returncode == 2 and "not a systemd size" in result.stderr and "Traceback" not in result.stderr


def test_install_service_as_root_checks_enrollment_and_systemd(monkeypatch, tmp_path):
    monkeypatch.setattr(service.os, "geteuid", lambda: 0)
    code, text = service.install(tmp_path / "agent.toml", "70%", dry_run=False, dest=tmp_path / "unit")
    assert code == 1 and "enroll first" in text
    (tmp_path / "agent.toml").write_text("")
    monkeypatch.setattr(service.Path, "is_dir", lambda self: False if str(self) == "/run/systemd/system" else True)
    code, text = service.install(tmp_path / "agent.toml", "70%", dry_run=False, dest=tmp_path / "unit")
    assert code == 1 and "systemd is not running" in text and not (tmp_path / "unit").exists()


def test_a_relative_config_path_is_rendered_absolute(tmp_path, monkeypatch):
    """systemd reads LoadCredential= paths from /, not from where install-service ran."""
    monkeypatch.chdir(tmp_path)
    text = service.render_unit(Path("a07/agent.toml"), command="/usr/bin/edge-agent")
    assert f"LoadCredential=agent.toml:{tmp_path}/a07/agent.toml" in text.splitlines()


# edge-agent install-service --serve ---------------------------------------------------------------
def agent_config(tmp_path: Path, **serving: str) -> Path:
    from edgefl_protocol.settings import to_toml
    path = tmp_path / "agent.toml"
    path.write_text(to_toml({
        "broker": {"host": "127.0.0.1", "port": 1883, "username": "pi-07", "password": "x"},
        "device": {"id": "pi-07", "data": str(tmp_path / "data.npz"), "state_dir": str(tmp_path / "state"),
                   "federation": "orchard"},
        **({"serving": serving} if serving else {})}))
    return path


def test_install_service_serve_plans_the_store_the_group_and_both_units(tmp_path):
    config = agent_config(tmp_path, dir=str(tmp_path / "serving"), group="edgefl-test-model")
    p = service.plan(config, "70%", tmp_path / "edge-agent.service", serve=True)
    agent, serve = (directives(text) for text in p.units.values())
    assert [d.name for d in p.units] == ["edge-agent.service", "edge-agent-serve.service"]
    assert agent["ReadWritePaths"] == [str(tmp_path / "serving")] and agent["SupplementaryGroups"] == ["edgefl-test-model"]
    assert agent["DynamicUser"] == ["yes"] and agent["StateDirectory"] == ["edgefl-agent"]  # the state stays private
    assert f"serve --dir {tmp_path / 'serving'} --socket /run/edgefl-serve/serve.sock --group edgefl-test-model" \
        in serve["ExecStart"][0]
    assert serve["ReadOnlyPaths"] == [f"-{tmp_path / 'serving'}"] and serve["SupplementaryGroups"] == ["edgefl-test-model"]
    commands = [" ".join(c) for c in p.commands]
    assert "groupadd --system edgefl-test-model" in commands  # the group does not exist here
    assert f"install -d -o edge-agent -g edgefl-test-model -m 2750 {tmp_path / 'serving'}" in commands
    assert commands[-1] == "systemctl enable --now edge-agent.service edge-agent-serve.service"


@needs_analyze
def test_install_service_serve_units_pass_systemd_analyze_verify(tmp_path):
    config = agent_config(tmp_path, dir=str(tmp_path / "serving"), group="edgefl-test-model")
    p = service.plan(config, "512M", tmp_path / "edge-agent.service", serve=True)
    for dest, text in p.units.items():
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", text, flags=re.M)  # an absolute program
        result = verify(tmp_path, dest.name, text)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (dest.name, result.stderr)


@pytest.mark.parametrize("serving, says", [
    ({}, "inside the agent's state directory"),  # the default <state_dir>/serving
    ({"dir": ""}, '[serving] dir is "" (no serving store)'),
    ({"dir": "/var/lib/edgefl-serving"}, "[serving] group is not set"),
])
def test_install_service_serve_says_what_to_set(tmp_path, serving, says):
    config = agent_config(tmp_path, **serving)
    result = run_module("edge_agent", "install-service", "--serve", "--dry-run", "--config", str(config))
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert 'set [serving] dir = "/var/lib/edgefl-serving" and group = "edgefl-model"' in result.stderr
