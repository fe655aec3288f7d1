"""`edge-agent install-service` and `edge-agent status`.

With --serve, install-service also installs systemd/edge-agent-serve.service and puts the serving
store where applications can read it (serve_service.py).

The unit file is systemd/edge-agent.service from this project (installed by
the wheel as VENV/share/edgefl/systemd/edge-agent.service), with ExecStart
pointed at this installation and MemoryMax set for the device. The agent's
config (which holds its password) stays root-only in /etc/edgefl; systemd
hands it to the service through LoadCredential=, so the service can run as a
DynamicUser that owns nothing but /var/lib/edgefl-agent.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgefl_protocol.persist import atomic_write

from .serve_service import SERVE_UNIT_NAME, ServingSetup, ServingSetupError

if TYPE_CHECKING:
    from .config import AgentConfig

UNIT_NAME = "edge-agent.service"
# systemd/ of the source tree (an editable install), else the copy the wheel installs (pyproject's data-files)
_SOURCE_UNIT = Path(__file__).resolve().parent.parent / "systemd" / UNIT_NAME
UNIT_TEMPLATE = _SOURCE_UNIT if _SOURCE_UNIT.exists() else Path(sys.prefix) / "share/edgefl/systemd" / UNIT_NAME
UNIT_DEST = Path("/etc/systemd/system") / UNIT_NAME
SERVE_TEMPLATE = UNIT_TEMPLATE.with_name(SERVE_UNIT_NAME)
DEFAULT_MEMORY_MAX = "70%"
_MEMORY = re.compile(r"^(\d+[KMGT]?|\d{1,3}%|infinity)$")


class ServiceError(Exception):
    """Installing or querying the service failed; the message says what to do."""


def exec_start_prefix() -> str:
    """How systemd should start this installation's agent."""
    script = Path(sys.executable).with_name("edge-agent")
    if script.exists():
        return str(script)
    return f"{sys.executable} -m edge_agent"


def render_unit(config: Path, memory_max: str = DEFAULT_MEMORY_MAX, template: Path = UNIT_TEMPLATE,
                command: str | None = None) -> str:
    if not _MEMORY.match(memory_max):
        raise ServiceError(f"--memory-max {memory_max!r} is not a systemd size: use e.g. 512M, 1G or 70%")
    try:
        text = template.read_text()
    except OSError:
        raise ServiceError(f"unit template {template} is missing: reinstall the edgefl wheel") from None
    # systemd wants an absolute path here (a relative one would be read from /)
    text = re.sub(r"^LoadCredential=agent.toml:.*$", f"LoadCredential=agent.toml:{Path(config).absolute()}", text,
                  flags=re.M)
    text = re.sub(r"^MemoryMax=.*$", f"MemoryMax={memory_max}", text, flags=re.M)
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={command or exec_start_prefix()}", text, count=1, flags=re.M)
    return text


@dataclass
class Plan:
    units: dict[Path, str]  # where each unit file goes -> its text
    commands: list[list[str]]


def plan(config: Path, memory_max: str, dest: Path = UNIT_DEST, serve: bool = False) -> Plan:
    agent = render_unit(config, memory_max)
    if not serve:
        return Plan({dest: agent}, [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", dest.name]])
    try:
        setup = ServingSetup.from_config(config)
        template = SERVE_TEMPLATE.read_text()
    except ServingSetupError as exc:
        raise ServiceError(str(exc)) from None
    except OSError:
        raise ServiceError(f"unit template {SERVE_TEMPLATE} is missing: reinstall the edgefl wheel") from None
    serve_dest = dest.with_name(SERVE_UNIT_NAME)
    return Plan({dest: setup.agent_unit(agent), serve_dest: setup.serve_unit(template, exec_start_prefix())},
                [*setup.commands(), ["systemctl", "daemon-reload"],
                 ["systemctl", "enable", "--now", dest.name, serve_dest.name]])


def describe(p: Plan, sudo: bool) -> str:
    prefix = "sudo " if sudo else ""
    lines = []
    for dest, text in p.units.items():
        lines += [f"# write {dest} (mode 0644):", *("    " + line for line in text.rstrip().splitlines()),
                  f"{prefix}install -m 0644 <the unit above> {dest}"]
    lines += [prefix + shlex.join(c) for c in p.commands]
    return "\n".join(lines)


def install(config: Path, memory_max: str, dry_run: bool, dest: Path = UNIT_DEST,
            serve: bool = False) -> tuple[int, str]:
    """Return (exit code, what to print)."""
    if serve and not config.exists():
        return 1, f"{config} does not exist: enroll first with 'sudo edge-agent enroll TOKEN'"
    p = plan(config, memory_max, dest, serve)
    if dry_run:
        return 0, "dry run; would do:\n" + describe(p, sudo=False)
    if os.geteuid() != 0:
        return 1, ("installing a system service needs root; run 'sudo edge-agent install-service', "
                   "or these commands:\n" + describe(p, sudo=True))
    if not config.exists():
        return 1, f"{config} does not exist: enroll first with 'sudo edge-agent enroll TOKEN'"
    if shutil.which("systemctl") is None or not Path("/run/systemd/system").is_dir():
        return 1, "systemd is not running on this machine; start the agent with 'edge-agent run --config ...' instead"
    for unit_dest, text in p.units.items():
        atomic_write(unit_dest, text, 0o644)
    for command in p.commands:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return 1, f"'{shlex.join(command)}' failed: {done.stderr.strip() or done.stdout.strip()}"
    names = " and ".join(d.name for d in p.units)
    return 0, f"installed and started {names}; check it with 'edge-agent status'"


def service_state() -> str:
    if shutil.which("systemctl") is None or not Path("/run/systemd/system").is_dir():
        return "unknown (systemd is not running here)"
    done = subprocess.run(["systemctl", "is-active", UNIT_NAME], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def status(config_path: Path, timeout: float = 5.0) -> tuple[int, list[str]]:
    """Enrolled or not, broker reachable, last round, the owner's conditions and whether it may train
    now, service state. Exit 0 when enrolled and reachable.
    While the agent is connected, its session file says so: signing in as the device here would
    drop the agent's own session (the broker lets one connection per device in)."""
    from edgefl_protocol.settings import ConfigError

    from .config import load_config
    from .runtime import running_session
    from .state import DeviceState

    if not config_path.exists():
        return 1, [f"enrolled:   no ({config_path} does not exist): run 'sudo edge-agent enroll TOKEN'"]
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        hint = ": run 'sudo edge-agent status'" if "not readable" in str(exc) else ""
        return 1, [f"enrolled:   config unusable: {exc}{hint}"]
    b, d = config.broker, config.device
    lines = [f"enrolled:   yes, device {d.id} in federation {d.federation} ({config_path})"]
    session = running_session(d.state_dir)
    if session and session.get("connected"):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(session.get("since", 0)))
        lines.append(f"broker:     {b.host}:{b.port} reachable, credentials accepted{' (TLS)' if b.tls_ca else ''}: "
                     f"the agent (pid {session['pid']}) is connected since {since}")
        reachable = True
    else:  # no agent holds a connection: signing in disturbs nobody
        reachable, line = _check_credentials(config, timeout)
        if session:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(session.get("since", 0)))
            line += f" (the agent, pid {session['pid']}, lost its session at {since}: {session.get('reason')}; " \
                    "it keeps retrying)"
        lines.append(line)
    state = DeviceState(d.state_dir).data if Path(d.state_dir).is_dir() else {}
    last = state.get("last_round")
    lines.append(f"last round: {last if last is not None else 'none yet'}"
                 + (f" (model version {state.get('last_model_version')})" if last is not None else ""))
    verdict = state.get("last_verdict")
    if isinstance(verdict, dict) and verdict.get("kind"):
        lines.append(f"last verdict: round {verdict.get('round')}: {verdict['kind']}"
                     + (f" ({verdict['detail']})" if verdict.get("detail") else ""))
    if upgrade := state.get("upgrade_required"):  # the coordinator's notice (edge_agent/upgrade.py)
        lines.append(f"upgrade:    required: {upgrade}")
    lines += conditions_lines(config)
    lines.append(f"service:    {service_state()}")
    return (0 if reachable else 1), lines


def conditions_lines(config: AgentConfig) -> list[str]:
    """The owner's conditions and whether the device may train now, read as the agent reads them."""
    from .conditions import Conditions
    conditions = Conditions(config.conditions, config.device.state_dir)
    why = conditions.check()
    return [f"conditions: {conditions.describe()}",
            f"may train:  {'yes' if why is None else f'no: {why}'}"]


def _check_credentials(config, timeout: float) -> tuple[bool, str]:  # noqa: ANN001 - an AgentConfig
    """Sign in as the device once: (accepted, the line to print)."""
    from edgefl_protocol.transport import BrokerUnavailable, connect, make_client
    b, d = config.broker, config.device
    client = make_client(f"{d.id}-status-{os.getpid()}", b.username, b.password, reconnect_on_failure=False,
                         tls_ca=b.tls_ca or None)
    try:
        connect(client, b.host, b.port, timeout=timeout)
    except (BrokerUnavailable, OSError, ValueError) as exc:
        hint = ("the credentials were refused: the device may have been revoked or rotated; ask the operator "
                "for a new token" if "refused" in str(exc) else "check the network and the broker")
        return False, f"broker:     {exc}; {hint}"
    client.disconnect()
    client.loop_stop()
    return True, f"broker:     {b.host}:{b.port} reachable, credentials accepted{' (TLS)' if b.tls_ca else ''}"
