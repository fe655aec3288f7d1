"""A Mosquitto of our own on loopback, for `simulate`, the benchmarks and the tests: a generated
config with credentials and an ACL (the production renderers of `access.broker`), started on a
free port and stopped exactly as it was started."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from broker_coordinator.access.broker import (
    COORDINATOR_USER,
    BrokerError,
    exited,
    find_mosquitto,
    free_port,
    port_in_use,
    render_acl,
    render_config,
    render_password_file,
)
from broker_coordinator.simulation.processes import stop_processes
from edgefl_protocol import topics
from edgefl_protocol.persist import atomic_write

PORT_TRIES = 5  # fresh ports tried when the one picked is taken before mosquitto binds it


@dataclass
class PrivateBroker:
    """A Mosquitto of our own on loopback: generated config, credentials and ACL.

    Use as a context manager; it stops exactly the process it started.
    """

    workdir: Path
    federation: str
    users: dict[str, str] = field(default_factory=dict)  # user -> password
    port: int = 0  # 0: pick a free port
    max_packet_size: int = 16 * 1024 * 1024
    mosquitto: str | None = None
    host: str = "127.0.0.1"
    max_queued_messages: int = 1000
    extra_acl: str = ""  # appended to the generated ACL (e.g. a site bridge's user, see `sites`)
    extra_conf: str = ""  # appended to the generated config (e.g. a bridge's `connection` block)
    process: subprocess.Popen | None = None

    def add_user(self, name: str) -> str:
        topics.check_name("user", name)
        password = secrets.token_urlsafe(18)
        self.users[name] = password
        return password

    def start(self) -> "PrivateBroker":
        binary = find_mosquitto(self.mosquitto)
        if self.port and port_in_use(self.port, self.host):
            raise BrokerError(f"port {self.port} on {self.host} is already in use: choose another with --broker-port, "
                              "or 0 for a free one")
        picked = not self.port  # a port we pick is free when picked; another process can bind it before mosquitto
        for attempt in range(1, PORT_TRIES + 1):
            if picked:
                self.port = free_port(self.host)
            try:
                self._launch(binary)
                return self
            except BrokerError as exc:
                if not picked or attempt == PORT_TRIES or "Address already in use" not in str(exc):
                    raise
        raise AssertionError("unreachable")

    def _launch(self, binary: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        passwd, acl, conf = self.workdir / "passwd", self.workdir / "acl", self.workdir / "mosquitto.conf"
        _write_private(passwd, render_password_file(self.users))
        _write_private(acl, render_acl(self.federation, COORDINATOR_USER, self.users) + self.extra_acl)
        run_as = _current_user() if os.geteuid() == 0 else None
        _write_private(conf, render_config(self.port, passwd, acl, self.max_packet_size, self.host, run_as,
                                                max(self.max_queued_messages, 2 * len(self.users)))
                       + "log_type information\n"  # its "running" line: this process, not another, listens
                       + self.extra_conf)
        log = self.workdir / "mosquitto.log"
        with open(log, "wb") as out:
            self.process = subprocess.Popen([binary, "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        try:
            self._wait_until_running(log)
        except BaseException:
            self.stop()
            raise

    def _wait_until_running(self, log: Path, timeout: float = 15.0) -> None:
        """Until this mosquitto logs that it runs, which it does once its listeners are open (a port that
        answers may be another broker's), or raise if it exits first."""
        assert self.process is not None
        give_up = time.monotonic() + timeout
        while self.process.poll() is None:
            if " running" in log.read_text(errors="replace"):
                return
            if time.monotonic() > give_up:
                raise BrokerError(f"mosquitto did not report running within {timeout:.0f} s (log: {log})")
            time.sleep(0.02)
        raise exited(self.process, log)

    def stop(self) -> None:
        if self.process:
            stop_processes([self.process], timeout=10)
        self.process = None

    def __enter__(self) -> "PrivateBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _write_private(path: Path, text: str) -> None:
    atomic_write(path, text, 0o600)


def _current_user() -> str:
    import pwd
    return pwd.getpwuid(os.geteuid()).pw_name
