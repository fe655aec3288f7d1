"""A production-shaped server for the enrollment and security tests.

`server` writes a coordinator config, runs `broker-config` (the project's own
conf.d fragment, password and ACL files), and starts Mosquitto the way
Debian does: a main mosquitto.conf with a pid file and `include_dir conf.d`.
Devices are added and revoked through the same code as the CLI, and the broker
is reloaded through the pid file. The fixture stops exactly the process it started.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker_coordinator.access import devices as ops
from broker_coordinator.access.broker import find_mosquitto, free_port, wait_for_port
from broker_coordinator.settings.config import CoordinatorConfig, load_config
from broker_coordinator.access.enrollment import EnrollmentDesk
from broker_coordinator.simulation.processes import stop_processes
from edgefl_protocol.transport import connect

PROJECT_ROOT = Path(__file__).resolve().parent.parent
FEDERATION = "field"


def write_coordinator_config(root: Path, port: int, extra_broker: str = "", message_size_limit: int = 1048576) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "coordinator.toml"
    path.write_text(f"""
[federation]
name = "{FEDERATION}"
model = "digits_mlp"
test_data = "{root}/test.npz"

[broker]
host = "127.0.0.1"
port = {port}
password = "coordinator-password-for-tests"
bind = "127.0.0.1"
passwd_file = "{root}/mosquitto/edgefl/passwd"
acl_file = "{root}/mosquitto/edgefl/acl"
conf_file = "{root}/mosquitto/conf.d/edgefl.conf"
pid_file = "{root}/run/mosquitto.pid"
reload_command = ""
message_size_limit = {message_size_limit}
{extra_broker}

[storage]
state_dir = "{root}/state"

[enrollment]
token_hours = 24.0

[rounds]
algorithm = "fedavg"
round_timeout = 30.0
""")
    return path


def debian_main_conf(root: Path) -> Path:
    """What Debian's /etc/mosquitto/mosquitto.conf does, in a temporary directory."""
    (root / "run").mkdir(parents=True, exist_ok=True)
    conf = root / "mosquitto" / "mosquitto.conf"
    lines = [f"pid_file {root}/run/mosquitto.pid", "persistence false", "log_dest stderr",
             "log_type error", "log_type warning", "log_type notice", f"include_dir {root}/mosquitto/conf.d"]
    if os.geteuid() == 0:
        lines.insert(0, "user root")  # tests run as root in CI: do not drop to 'mosquitto', whose files these are not
    conf.write_text("\n".join(lines) + "\n")
    return conf


@dataclass
class Server:
    root: Path
    config_path: Path
    config: CoordinatorConfig
    process: subprocess.Popen
    port: int

    def add(self, name: str) -> str:
        text, _, _ = ops.add_device(self.config, name)
        return text

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return run_module("broker_coordinator", *args, "--config", str(self.config_path), timeout=timeout)

    def log(self) -> str:
        return (self.root / "mosquitto.log").read_text(errors="replace")


def run_module(module: str, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=PROJECT_ROOT, env=environment)


def start_server(root: Path, extra_broker: str = "", device_port: int = 0, message_size_limit: int = 1048576) -> Server:
    """`message_size_limit = 0`: the broker's max_packet_size sized from the model, as by default."""
    port = free_port()
    if device_port:
        extra_broker += f"\ndevice_port = {device_port}\n"
    config_path = write_coordinator_config(root, port, extra_broker, message_size_limit)
    config = load_config(config_path, with_rounds=False)
    ops.write_broker_config(config)
    conf = debian_main_conf(root)
    log = root / "mosquitto.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([find_mosquitto(), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        wait_for_port(port, process, log)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return Server(root, config_path, config, process, port)


def stop_server(server: Server) -> None:
    stop_processes([server.process], timeout=10)


@pytest.fixture
def server(tmp_path) -> Iterator[Server]:
    s = start_server(tmp_path / "server")
    try:
        yield s
    finally:
        stop_server(s)


@contextlib.contextmanager
def desk_on(server: Server) -> Iterator[EnrollmentDesk]:
    """The enrollment desk on a coordinator session, in this process, as `broker-coordinator run` has it."""
    client = ops.coordinator_client(server.config, "desk")
    connect(client, "127.0.0.1", server.port, timeout=10)
    d = EnrollmentDesk(server.config, ops.open_registry(server.config))
    subscribed = threading.Event()
    client.on_subscribe = lambda *a: subscribed.set()
    d.attach(client)
    assert subscribed.wait(5)
    try:
        yield d
    finally:
        d.stop()
        client.disconnect()
        client.loop_stop()


@pytest.fixture
def desk(server) -> Iterator[EnrollmentDesk]:
    with desk_on(server) as d:
        yield d
