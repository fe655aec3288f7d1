"""The operator guide (docs/OPERATOR.md), command by command, as separate processes: generate the broker
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

from broker_coordinator.access import devices as ops
from broker_coordinator.access.broker import free_port
from broker_coordinator.settings.config import load_config
from broker_coordinator.simulation.processes import stop_processes
from edgefl_protocol import topics
from edgefl_protocol.transport import connect
from .operator_fixtures import FEDERATION, PROJECT_ROOT, debian_main_conf, run_module, write_coordinator_config

GUIDE = PROJECT_ROOT / "docs" / "OPERATOR.md"  # the operator guide (linked from the README)
# every `broker-coordinator ...` / `edge-agent ...` subcommand the guide shows, and where it is exercised
EXERCISED = {
    "broker-coordinator broker-config": "this file; --site: tests/test_sites.py",
    "broker-coordinator site-aggregator": "tests/test_sites.py (from the files broker-config --site wrote)",
    "broker-coordinator serve-enrollment": "tests/test_enrollment.py",
    "broker-coordinator run": "this file (one round; it hosts the enrollment desk)",
    "broker-coordinator status": "tests/test_runtime_e2e.py (test_status_command_reads_the_store)",
    "broker-coordinator resume": "tests/test_pacing_service.py",
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
    text = GUIDE.read_text()
    guide = text[text.index("## Operator guide"):]
    guide = guide[:guide.find("\n## ", 1)] if "\n## " in guide[1:] else guide
    found = set()
    for match in re.finditer(r"(broker-coordinator|edge-agent) (devices \w+|[a-z][a-z-]+)", guide):
        found.add(f"{match.group(1)} {match.group(2)}")
    return found


def test_every_command_of_the_guide_is_exercised():
    shown = guide_commands()
    assert shown, "docs/OPERATOR.md has no operator guide commands"
    assert shown <= set(EXERCISED), f"commands in the guide that no test runs: {shown - set(EXERCISED)}"


def wait_for(predicate, within: float, what: str) -> None:
    give_up = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_operator_guide_end_to_end(tmp_path):
    from broker_coordinator.access.broker import find_mosquitto, free_port, wait_for_port

    root = tmp_path / "server"
    port = free_port()
    config = write_coordinator_config(root, port)
    text = config.read_text().replace('model = "digits_mlp"', 'model = "digits_mlp"\nrounds = 1')
    config.write_text(text.replace("[rounds]", "[rounds]\nlocal_epochs = 1\nmin_updates = 1\nclients_per_round = 0"))
    rng = np.random.default_rng(0)
    np.savez(root / "test.npz", x=rng.normal(size=(20, 64)).astype(np.float32), y=rng.integers(0, 10, 20))
    coordinator = ("--config", str(config))

    # 2. generate the broker config, then start Mosquitto the way Debian's package does
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
        # 3. the coordinator service: one round here, and the enrollment desk
        service_log = root / "coordinator.log"
        with open(service_log, "wb") as out:
            service = subprocess.Popen([sys.executable, "-m", "broker_coordinator", "run", *coordinator],
                                       stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, env=env)
        processes.append(service)
        wait_for(lambda: b"connected to" in service_log.read_bytes(), 90, "the coordinator to connect")

        # 4. add the device on the server; the token is the line starting with edgefl1.
        added = run_module("broker_coordinator", "devices", "add", "pi-07", *coordinator)
        assert added.returncode == 0, added.stderr
        token = next(line for line in added.stdout.splitlines() if line.startswith("edgefl1."))

        # on the device: data, enroll
        device = tmp_path / "pi"
        state = device / "var/lib/edgefl-agent"
        state.mkdir(parents=True)
        np.savez(state / "data.npz", x=rng.normal(size=(40, 64)).astype(np.float32), y=rng.integers(0, 10, 40))
        agent_config = device / "etc/edgefl/agent.toml"
        enrolled = run_module("edge_agent", "enroll", token, "--config", str(agent_config), "--state-dir", str(state))
        assert enrolled.returncode == 0, enrolled.stderr
        assert len(enrolled.stdout.strip().splitlines()) == 1 and "enrolled pi-07" in enrolled.stdout
        assert oct(agent_config.stat().st_mode & 0o777) == "0o600"

        # 5. the agent runs (as its service would; importing torch takes a few seconds); preview the unit
        agent_log = open(device / "agent.log", "wb")
        processes.append(subprocess.Popen([sys.executable, "-m", "edge_agent", "run", "--config", str(agent_config)],
                                          stdout=agent_log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, env=env))
        preview = run_module("edge_agent", "install-service", "--dry-run", "--config", str(agent_config))
        assert preview.returncode == 0 and "systemctl enable --now edge-agent.service" in preview.stdout

        # 7. the federation: the coordinator runs its one round with the enrolled device, and says so
        # (`broker-coordinator status` on what it wrote is tests/test_runtime_e2e.py's job: it takes 8 s)
        assert service.wait(timeout=90) == 0, service_log.read_text()
        assert "finished 1 rounds" in service_log.read_text()

        # 6. online on both ends, with the round counted
        listing = run_module("broker_coordinator", "devices", "list", *coordinator)
        row = next(line.split() for line in listing.stdout.splitlines() if line.startswith("pi-07"))
        assert row[:3] == ["pi-07", "active", "online"] and row[-2:] == ["1", "1"], listing.stdout
        from edge_agent.state import DeviceState
        wait_for(lambda: DeviceState(state).data.get("last_verdict"), 30, "the agent to settle its round 1 update")
        session_file = state / "session.json"  # the running agent's: status reads it instead of signing in
        before = session_file.read_text()
        status = run_module("edge_agent", "status", "--config", str(agent_config))
        assert status.returncode == 0, status.stdout + status.stderr
        assert "enrolled:   yes, device pi-07" in status.stdout and "credentials accepted" in status.stdout
        assert "is connected since" in status.stdout and "last round: 1" in status.stdout
        assert "last verdict: round 1: folded" in status.stdout or "last verdict: round 1: clipped" in status.stdout, status.stdout
        # a marker on the agent's task topic, sent after status returned: the agent logs it (as not a task) once it
        # has read it, and a session dropped under it by then would have been noted in the session file first
        # (on_disconnect, then on_connect of the new session, before any message on that one)
        agent_output, ignored = device / "agent.log", f"ignored message on {topics.task(FEDERATION, 'pi-07')}".encode()
        seen = agent_output.read_bytes().count(ignored)
        marker = ops.coordinator_client(load_config(config, with_rounds=False), "marker")
        connect(marker, "127.0.0.1", port, timeout=10)
        try:
            marker.publish(topics.task(FEDERATION, "pi-07"), b"not a task", qos=1).wait_for_publish(10)
        finally:
            marker.disconnect()
            marker.loop_stop()
        wait_for(lambda: agent_output.read_bytes().count(ignored) > seen or session_file.read_text() != before, 30,
                 "the agent to read the marker")
        assert session_file.read_text() == before, "edge-agent status knocked the running agent off the broker"

        # revoke: the broker drops the agent's session and the credentials stop working
        revoked = run_module("broker_coordinator", "devices", "revoke", "pi-07", *coordinator)
        assert revoked.returncode == 0, revoked.stderr
        status = run_module("edge_agent", "status", "--config", str(agent_config))
        assert status.returncode == 1 and "refused" in status.stdout
        listing = run_module("broker_coordinator", "devices", "list", *coordinator)
        assert any(line.split()[:3] == ["pi-07", "revoked", "revoked"] for line in listing.stdout.splitlines())
    finally:
        stop_processes(reversed(processes))


def test_status_before_enrollment(tmp_path):
    result = run_module("edge_agent", "status", "--config", str(Path(tmp_path) / "agent.toml"))
    assert result.returncode == 1 and "enrolled:   no" in result.stdout and "edge-agent enroll" in result.stdout


def test_a_session_file_counts_only_while_its_agent_runs(tmp_path):
    import json

    from edge_agent.runtime import SESSION_FILE, running_session
    record = {"connected": True, "since": time.time(), "reason": ""}
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "edge_agent"])
    try:
        wait_for(lambda: Path(f"/proc/{agent.pid}/cmdline").read_bytes(), 10, "the process to start")
        (tmp_path / SESSION_FILE).write_text(json.dumps({**record, "pid": agent.pid}))
        assert running_session(tmp_path)["connected"]
        (tmp_path / SESSION_FILE).write_text(json.dumps({**record, "pid": os.getpid()}))  # alive, not an agent
        assert running_session(tmp_path) is None
    finally:
        agent.kill()
        agent.wait()
    (tmp_path / SESSION_FILE).write_text(json.dumps({**record, "pid": agent.pid}))  # gone
    assert running_session(tmp_path) is None


def test_device_management_commands_start_without_torch(tmp_path):
    """`broker-config` and `devices add / list / revoke` read the config without [rounds]
    (config.load_config(with_rounds=False)), so they never import torch: they answer in a fraction of
    a second on a Pi, not after the seconds torch's import takes."""
    config = write_coordinator_config(tmp_path / "server", free_port())
    probe = ("import sys\nfrom broker_coordinator.cli.cli import main\n"
             "for command in (['broker-config'], ['devices', 'add', 'pi-07'], ['devices', 'revoke', 'pi-07']):\n"
             "    main([*command, '--config', sys.argv[1]])\n"
             "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe, str(config)], check=False, capture_output=True, text=True,
                            timeout=60, cwd=PROJECT_ROOT, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert result.stdout.strip().splitlines()[-1:] == ["False"], result.stdout + result.stderr
