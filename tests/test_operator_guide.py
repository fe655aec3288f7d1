"""The README's operator guide, command by command, as separate processes: generate the broker
config, run the enrollment desk, add a device, enroll it, preview the service, run the agent, see
it online from both ends, revoke it. Paths point into a temporary directory instead of /etc and
/var/lib; everything else is what an operator types."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .operator_fixtures import PROJECT_ROOT, debian_main_conf, run_module, write_coordinator_config

README = PROJECT_ROOT / "README.md"
# every `broker-coordinator ...` / `edge-agent ...` subcommand the guide shows, and where it is exercised
EXERCISED = {
    "broker-coordinator broker-config": "this file",
    "broker-coordinator serve-enrollment": "this file",
    "broker-coordinator devices add": "this file",
    "broker-coordinator devices list": "this file",
    "broker-coordinator devices revoke": "this file",
    "broker-coordinator devices rotate": "tests/test_enrollment.py (rotate) via the same code path",
    "edge-agent enroll": "this file",
    "edge-agent install-service": "this file (--dry-run) and tests/test_systemd.py",
    "edge-agent status": "this file",
    "edge-agent run": "this file",
}


def guide_commands() -> set[str]:
    text = README.read_text()
    guide = text[text.index("## Operator guide"):]
    guide = guide[:guide.find("\n## ", 1)] if "\n## " in guide[1:] else guide
    found = set()
    for match in re.finditer(r"(broker-coordinator|edge-agent) (devices \w+|[a-z][a-z-]+)", guide):
        found.add(f"{match.group(1)} {match.group(2)}")
    return found


def test_every_command_of_the_guide_is_exercised():
    shown = guide_commands()
    assert shown, "the README has no operator guide commands"
    pending = {"broker-coordinator run"}  # the round loop's service command (issue 5): exercised there
    assert shown - pending <= set(EXERCISED), f"commands in the guide that no test runs: {shown - set(EXERCISED) - pending}"


def wait_for(predicate, within: float, what: str) -> None:
    give_up = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_operator_guide_end_to_end(tmp_path):
    from broker_coordinator.broker import find_mosquitto, free_port, wait_for_port

    root = tmp_path / "server"
    port = free_port()
    config = write_coordinator_config(root, port)
    coordinator = ("--config", str(config))

    # generate the broker config, then start Mosquitto the way Debian's package does
    done = run_module("broker_coordinator", "broker-config", *coordinator)
    assert done.returncode == 0, done.stderr
    assert f"listener {port}" in done.stdout
    conf = debian_main_conf(root)
    log = root / "mosquitto.log"
    processes: list[subprocess.Popen] = []
    with open(log, "wb") as out:
        processes.append(subprocess.Popen([find_mosquitto(), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    try:
        wait_for_port(port, processes[0], log)
        desk_log = open(root / "desk.log", "wb")
        processes.append(subprocess.Popen([sys.executable, "-m", "broker_coordinator", "serve-enrollment", *coordinator],
                                          stdout=desk_log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, env=env))
        wait_for(lambda: b"enrollment desk" in (root / "desk.log").read_bytes(), 20, "the enrollment desk")

        # add the device on the server; the token is the line starting with edgefl1.
        added = run_module("broker_coordinator", "devices", "add", "pi-07", *coordinator)
        assert added.returncode == 0, added.stderr
        token = next(line for line in added.stdout.splitlines() if line.startswith("edgefl1."))

        # on the device: data, enroll, preview the service
        device = tmp_path / "pi"
        state = device / "var/lib/edgefl-agent"
        state.mkdir(parents=True)
        rng = np.random.default_rng(0)
        np.savez(state / "data.npz", x=rng.normal(size=(40, 64)).astype(np.float32), y=rng.integers(0, 10, 40))
        agent_config = device / "etc/edgefl/agent.toml"
        enrolled = run_module("edge_agent", "enroll", token, "--config", str(agent_config), "--state-dir", str(state))
        assert enrolled.returncode == 0, enrolled.stderr
        assert len(enrolled.stdout.strip().splitlines()) == 1 and "enrolled pi-07" in enrolled.stdout
        assert oct(agent_config.stat().st_mode & 0o777) == "0o600"

        # the agent runs (as the service would; it takes a few seconds to import torch) ...
        agent_log = open(device / "agent.log", "wb")
        processes.append(subprocess.Popen([sys.executable, "-m", "edge_agent", "run", "--config", str(agent_config)],
                                          stdout=agent_log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, env=env))
        preview = run_module("edge_agent", "install-service", "--dry-run", "--config", str(agent_config))
        assert preview.returncode == 0 and "systemctl enable --now edge-agent.service" in preview.stdout

        # ... and shows up online on both ends
        wait_for(lambda: b"connected as pi-07" in (device / "agent.log").read_bytes(), 30, "the agent to connect")

        def listed_online() -> bool:
            listing = run_module("broker_coordinator", "devices", "list", *coordinator)
            return any(line.split()[:3] == ["pi-07", "active", "online"] for line in listing.stdout.splitlines())
        wait_for(listed_online, 30, "pi-07 to be listed online")

        status = run_module("edge_agent", "status", "--config", str(agent_config))
        assert status.returncode == 0, status.stdout + status.stderr
        assert "enrolled:   yes, device pi-07" in status.stdout and "credentials accepted" in status.stdout

        # revoke: the broker drops the agent's session and the credentials stop working
        revoked = run_module("broker_coordinator", "devices", "revoke", "pi-07", *coordinator)
        assert revoked.returncode == 0, revoked.stderr
        status = run_module("edge_agent", "status", "--config", str(agent_config))
        assert status.returncode == 1 and "refused" in status.stdout
        listing = run_module("broker_coordinator", "devices", "list", *coordinator)
        assert any(line.split()[:3] == ["pi-07", "revoked", "revoked"] for line in listing.stdout.splitlines())
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def test_status_before_enrollment(tmp_path):
    result = run_module("edge_agent", "status", "--config", str(Path(tmp_path) / "agent.toml"))
    assert result.returncode == 1 and "enrolled:   no" in result.stdout and "edge-agent enroll" in result.stdout
