"""`make service-check`: the operator guide (docs/OPERATOR.md), run as written under systemd as PID 1.

A Debian bookworm amd64 root (debootstrap with systemd, systemd-sysv, dbus,
polkitd, Mosquitto; cached in /var/cache/edgefl-service-root) is copied fresh
and booted with `systemd-nspawn -b --register=no --keep-unit`; every command
runs inside it through `nsenter -t PID -a`, as root, the way an operator types
it (with `sudo`). The server (Mosquitto, the coordinator service) and the
"Pi" (the agent service) share this one container: two nspawn containers on
the host's network would share the same loopback anyway, and one boot halves
the time. The guide's blocks are read from docs/OPERATOR.md by their HTML comment
markers (checks/pi/guide.py) and run as written: the operator's `make dist` here, the
wheel put where its `scp` puts it, the server's install block and the coordinator
service's in the container. pip there finds torch in this machine's local CPU wheel
through its pip configuration, bound read-only into the container (when PyTorch's CPU
index is not reachable, as here).

Writes bench/results/service_check.json: {"steps": [{"name", "ok", "detail"}], "passed", "total"}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import provenance

from . import guide as guide_blocks
from . import root as roots

PROJECT = Path(__file__).resolve().parents[2]
RESULTS = PROJECT / "bench" / "results"
INCLUDE = ("systemd,systemd-sysv,dbus,libpam-systemd,polkitd,sudo,procps,iproute2,mosquitto,mosquitto-clients,"
           "python3,python3-venv,python3-pip,ca-certificates")  # no git, make: the guide installs a wheel
LOCAL_WHEELS = ["/opt/wheels", "/opt/pypi", "/opt/pypi-more"]  # this machine's pip sources, when present
PIP_CONFIGS = ["etc/pip.conf", "etc/xdg/pip", "root/.config/pip"]
VENV = "/opt/edgefl/.venv/bin"


class Container:
    """One booted systemd-nspawn container and `nsenter` into it."""

    def __init__(self, root: Path, log: Path):
        self.root, self.log = root, log
        self.process: subprocess.Popen | None = None
        self.pid = 0

    def boot(self, timeout: float = 120) -> str:
        if not Path("/run/dbus/system_bus_socket").exists():
            Path("/run/dbus").mkdir(parents=True, exist_ok=True)
            subprocess.run(["dbus-daemon", "--system", "--fork"], check=True)
        binds = [f"--bind-ro={p}" for p in LOCAL_WHEELS if Path(p).is_dir()]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(["systemd-nspawn", "-D", str(self.root), "-b", "--register=no",
                                             "--keep-unit", "-M", "edgefl-svc", *binds],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        give_up = time.monotonic() + timeout
        while not self.pid and time.monotonic() < give_up:
            self.pid = self._find_init()
            time.sleep(0.5)
        if not self.pid:
            raise roots.SetupError(f"the container did not boot; see {self.log}")
        state = ""
        while time.monotonic() < give_up:
            state = self.sh("systemctl is-system-running").stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(1)
        return state

    def _find_init(self) -> int:
        """The container's PID 1: a systemd whose namespaced pid is 1, descended from our nspawn."""
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            nspid = re.search(r"^NSpid:\s*(.*)$", text, re.M)
            if "Name:\tsystemd\n" in text and nspid and nspid.group(1).split()[-1] == "1" and len(nspid.group(1).split()) > 1:
                pid = int(status.parent.name)
                if self._descends(pid):
                    return pid
        return 0

    def _descends(self, pid: int) -> bool:
        while pid > 1:
            if self.process and pid == self.process.pid:
                return True
            try:
                pid = int(re.search(r"^PPid:\s*(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))
            except (OSError, AttributeError):
                return False
        return False

    def sh(self, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        env = {"PATH": roots.GUEST_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
        try:
            return subprocess.run(["nsenter", "-t", str(self.pid), "-a", "/bin/sh", "-c", command],
                                  capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(command, 124, str(exc.stdout or ""), f"timed out after {timeout} s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to power off
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Check:
    def __init__(self, container: Container, echo):
        self.c, self.echo = container, echo
        self.steps: list[dict] = []
        self.transcript: list[str] = []

    def run(self, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        done = self.c.sh(command, timeout)
        self.transcript.append(f"# {command}\n{done.stdout}{done.stderr}(exit {done.returncode})\n")
        return done

    def step(self, name: str, ok: bool, detail: str) -> bool:
        self.steps.append({"name": name, "ok": bool(ok), "detail": detail.strip()[-1200:]})
        self.echo(f"{'ok  ' if ok else 'FAIL'} {name}: {detail.strip().splitlines()[-1] if detail.strip() else ''}")
        return bool(ok)

    def command_step(self, name: str, command: str, expect: str | None = None, timeout: float = 600) -> bool:
        done = self.run(command, timeout)
        text = (done.stdout + done.stderr).strip()
        ok = done.returncode == 0 and (expect is None or re.search(expect, done.stdout.strip()) is not None)
        return self.step(name, ok, f"$ {command}\n{text}\n(exit {done.returncode})")

    def wait_until(self, command: str, pattern: str, within: float) -> tuple[bool, str]:
        give_up, text = time.monotonic() + within, ""
        while time.monotonic() < give_up:
            done = self.run(command, 60)
            text = (done.stdout + done.stderr).strip()
            if re.search(pattern, text):
                return True, text
            time.sleep(3)
        return False, text

    def unit_value(self, unit: str, prop: str) -> str:
        return self.run(f"systemctl show -p {prop} --value {unit}").stdout.strip()


def prepare_root(base: Path, root: Path) -> None:
    roots.fresh_copy(base, root)
    for relative in PIP_CONFIGS:
        source = Path("/") / relative
        if source.is_dir():
            shutil.copytree(source, root / relative, dirs_exist_ok=True)
        elif source.exists():
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / relative)
    (root / "etc/hostname").write_text("edgefl-server\n")
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\tedgefl-server\n")  # as an installed Debian has


def coordinator_toml(password: str) -> str:
    """The guide's /etc/edgefl/coordinator.toml; the check's changes are commented."""
    return f'''[federation]
name = "greenhouse"
model = "mnist_cnn"
test_data = "/var/lib/edgefl-coordinator/test.npz"

[broker]
password = "{password}"
device_host = "127.0.0.1"   # the check: the device is on this machine

[rounds]
clients_per_round = 1       # the check has one device (the guide: 10)
min_updates = 1             # (the guide: 5)
local_epochs = 1            # short rounds for the check
round_timeout = 120.0
'''


def write_data(root: Path) -> None:
    """The coordinator's held-out set and the device's own data, from the bundled MNIST-5k."""
    from edgefl_models import datasets
    data = datasets.load("mnist5k")
    tmp = root / "root"
    np.savez(tmp / "test.npz", x=data.test.x[:300], y=data.test.y[:300])
    np.savez(tmp / "data.npz", x=data.train.x[:256], y=data.train.y[:256])


def guide(check: Check, root: Path) -> None:
    run, step, cmd = check.run, check.step, check.command_step
    # 1. install: the operator's make dist here, the wheel where the guide's scp puts it, the server's block
    try:
        live = Path(f"/proc/{check.c.pid}/root")  # the booted system's /tmp is its own tmpfs, as on a server
        for done in guide_blocks.operator_side("build", live, echo=lambda line: None):
            step(f"1. {done['command']} (the operator's machine)", done.get("exit", 0) == 0, done["ran"])
        install, service = guide_blocks.block("server-install"), guide_blocks.block("coordinator-service")
    except guide_blocks.GuideError as exc:
        step("1. the guide's blocks (docs/OPERATOR.md)", False, str(exc))
        return
    for line in install:
        if not cmd(f"1. {line}", line, timeout=1800):
            return
    (root / "etc/edgefl/coordinator.toml").write_text(coordinator_toml(secrets.token_urlsafe(24)))
    cmd("1. /etc/edgefl/coordinator.toml (mode 0640, group edgefl) and the test set",
        "chgrp edgefl /etc/edgefl/coordinator.toml && chmod 0640 /etc/edgefl/coordinator.toml && "
        "install -o edgefl -g edgefl -m 0640 /root/test.npz /var/lib/edgefl-coordinator/test.npz && "
        "ls -l /etc/edgefl/coordinator.toml")
    # 2. broker configuration
    cmd("2. broker-config and restart mosquitto",
        f"sudo {VENV}/broker-coordinator broker-config && sudo systemctl restart mosquitto && "
        "sleep 1 && systemctl is-active mosquitto", expect=r"^active$|\nactive$")
    # 3. coordinator service
    for line in service:
        cmd(f"3. {line}", line)
    ok, text = check.wait_until("systemctl is-active broker-coordinator", r"^active$", 30)
    step("3. broker-coordinator.service is active", ok, text)
    # 4. enroll
    added = run(f"sudo {VENV}/broker-coordinator devices add pi-07")
    token = re.search(r"^(edgefl1\.\S+)$", added.stdout, re.M)
    step("4. devices add pi-07 (one-time token)", added.returncode == 0 and token is not None,
         added.stdout + added.stderr)
    if token is None:
        return
    cmd("4. edge-agent enroll",
        "sudo install -D -m 0644 /root/data.npz /var/lib/edgefl-agent/data.npz && "
        f"sudo {VENV}/edge-agent enroll '{token.group(1)}'", expect="enrolled pi-07", timeout=120)
    # 5. agent service
    cmd("5. edge-agent install-service --memory-max 512M",
        f"sudo {VENV}/edge-agent install-service --memory-max 512M && sleep 3 && systemctl is-active edge-agent",
        expect=r"active$")
    # 6. online
    ok, text = check.wait_until(f"sudo {VENV}/edge-agent status", r"credentials accepted[\s\S]*service:\s+active", 90)
    step("6. edge-agent status", ok, text)
    ok, text = check.wait_until(f"sudo {VENV}/broker-coordinator devices list", r"pi-07\s+active\s+online", 90)
    step("6. devices list shows pi-07 online", ok, text)
    # 7. rounds
    status = f"sudo {VENV}/broker-coordinator status --config /etc/edgefl/coordinator.toml"
    ok, text = check.wait_until(status, r"last round [2-9]", 420)
    step("7. rounds run under the services (broker-coordinator status)", ok, text)
    hardening(check)
    restarts(check, status)
    # revoke
    cmd("revoke: devices revoke pi-07", f"sudo {VENV}/broker-coordinator devices revoke pi-07", expect="revoked")
    ok, text = check.wait_until(f"sudo {VENV}/edge-agent status; true", r"refused|not authori[sz]ed", 60)
    step("revoke: the device's credentials are refused at once (edge-agent status)", ok, text)
    ok, text = check.wait_until(f"sudo {VENV}/broker-coordinator devices list", r"pi-07\s+revoked", 30)
    step("revoke: devices list shows pi-07 revoked", ok, text)


def last_round(check: Check, status: str) -> int:
    match = re.search(r"last round (\d+)", check.run(status).stdout)
    return int(match.group(1)) if match else 0


def hardening(check: Check) -> None:
    unit, run, step = "edge-agent.service", check.run, check.step
    pid = check.unit_value(unit, "MainPID")
    user = run(f"ps -o user=,uid= -p {pid}").stdout.split()
    passwd = run("cut -d: -f3 /etc/passwd").stdout.split()
    uid = user[1] if len(user) == 2 else "65534"
    step("hardening: DynamicUser (the agent runs as a uid created at start, in no /etc/passwd entry)",
         len(user) == 2 and user[1] != "0" and user[1] not in passwd and check.unit_value(unit, "DynamicUser") == "yes",
         f"MainPID {pid} runs as {' '.join(user)}; DynamicUser={check.unit_value(unit, 'DynamicUser')}")
    creds = run(f"ls -l /run/credentials/{unit}/ && stat -c '%a %U' /etc/edgefl/agent.toml && "
                f"setpriv --reuid={uid} --regid={uid} --clear-groups cat /etc/edgefl/agent.toml; true")
    text = creds.stdout + creds.stderr
    step("hardening: LoadCredential (config root-only 0600; the service reads its copy from the credentials dir)",
         "agent.toml" in creds.stdout and "600 root" in creds.stdout and "Permission denied" in text, text)
    memory = check.unit_value(unit, "MemoryMax")
    # the kernel's limit on the agent's cgroup: cgroup v2 memory.max, or v1 memory.limit_in_bytes
    limit = run(f"p=$(grep -E '^0::|:memory:' /proc/{pid}/cgroup | sed 's/^[^:]*:[^:]*://' | tail -1); "
                f"cat /sys/fs/cgroup/$p/memory.max /sys/fs/cgroup/unified/$p/memory.max "
                f"/sys/fs/cgroup/memory/$p/memory.limit_in_bytes 2>/dev/null; "
                f"grep -E '^0::|:memory:' /proc/{pid}/cgroup; mount | grep -E 'cgroup.*(memory|cgroup2)'").stdout
    step("hardening: MemoryMax=512M on the agent's cgroup (the kernel's limit)",
         memory == str(512 * 2**20) and str(512 * 2**20) in limit.split(),
         f"unit MemoryMax={memory}; the agent's cgroup and the container's memory controller:\n{limit}")
    reload = run("runuser -u edgefl -- systemctl reload mosquitto.service")
    restart = run("runuser -u edgefl -- systemctl restart mosquitto.service")
    other = run("runuser -u nobody -- systemctl reload mosquitto.service")
    step("hardening: the polkit rule lets edgefl reload mosquitto, and only reload, and only edgefl",
         reload.returncode == 0 and restart.returncode != 0 and other.returncode != 0,
         f"reload as edgefl: exit {reload.returncode}; restart as edgefl: exit {restart.returncode} "
         f"({restart.stderr.strip().splitlines()[0] if restart.stderr.strip() else ''}); reload as nobody: exit "
         f"{other.returncode}. (The enrollment above needed this too: the service reloads Mosquitto as edgefl "
         "before the device's new password works.)")


def rounds_go_on(check: Check, status: str, before: int, within: float) -> int:
    """The last round number once it passes `before`, or 0 if it did not within the time."""
    give_up = time.monotonic() + within
    while time.monotonic() < give_up:
        now = last_round(check, status)
        if now > before:
            return now
        time.sleep(3)
    return 0


def restarts(check: Check, status: str) -> None:
    for unit in ("mosquitto", "broker-coordinator", "edge-agent"):
        done = check.run(f"sudo systemctl restart {unit} && sleep 2 && systemctl is-active {unit}")
        before = last_round(check, status)  # after the restart: a round must finish after it
        after = rounds_go_on(check, status, before, 300)
        check.step(f"systemctl restart {unit}: active again and rounds go on", done.returncode == 0 and after > 0,
                   f"{done.stdout.strip()}; last round {before} after the restart, then {after or 'none within 300 s'}")
    unit = "edge-agent.service"
    pid_before = check.unit_value(unit, "MainPID")
    restarts_before = check.unit_value(unit, "NRestarts")
    check.run(f"kill -KILL {pid_before}")
    ok, text = check.wait_until(f"systemctl show -p MainPID,NRestarts,ActiveState {unit}",
                                rf"NRestarts=(?!{restarts_before}\b)\d+[\s\S]*ActiveState=active|"
                                rf"ActiveState=active[\s\S]*NRestarts=(?!{restarts_before}\b)\d+", 90)
    pid_after = check.unit_value(unit, "MainPID")
    check.step("SIGKILL of the agent: Restart= brings it back (after RestartSec=30s)", ok and pid_after != pid_before,
               f"MainPID {pid_before} killed; now MainPID {pid_after}; {' '.join(text.split())}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path,
                        default=Path(os.environ.get("SERVICE_ROOT_CACHE", "/var/cache/edgefl-service-root")))
    args = parser.parse_args()
    echo = lambda line: print(line, flush=True)  # noqa: E731
    if os.geteuid() != 0:
        print("service-check: needs root (debootstrap, systemd-nspawn): run 'sudo make service-check'", file=sys.stderr)
        return 2
    missing = [n for n, p in [("debootstrap", "/usr/sbin/debootstrap"), ("systemd-container", "/usr/bin/systemd-nspawn"),
                              ("dbus", "/usr/bin/dbus-daemon")] if not Path(p).exists()]
    if missing:
        print(f"service-check: missing {', '.join(missing)}: run 'sudo apt-get install -y {' '.join(missing)}'",
              file=sys.stderr)
        return 2
    base, root, logs = args.cache / "base", args.cache / "server", args.cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        roots.build_base(base, echo, arch="amd64", include=INCLUDE)
        prepare_root(base, root)
        write_data(root)
    except roots.SetupError as exc:
        print(f"service-check: {exc}", file=sys.stderr)
        return 2
    measured_at = guide_blocks.commit()  # before the run: what ran, not what a later commit made of it
    container = Container(root, logs / "nspawn.log")
    check = Check(container, echo)
    try:
        state = container.boot()
        check.step("boot: systemd as PID 1 in systemd-nspawn", state in ("running", "degraded"),
                   f"PID {container.pid}; is-system-running: {state}")
        guide(check, root)
    except Exception as exc:  # recorded as a failed step, with what was reached
        check.step("unexpected error", False, f"{type(exc).__name__}: {exc}")
    finally:
        journal = check.run("journalctl --no-pager -n 300 -u edge-agent -u broker-coordinator -u mosquitto") \
            if container.pid else None
        container.stop()
    (logs / "transcript.log").write_text("\n".join(check.transcript) + (journal.stdout if journal else ""))
    passed = sum(s["ok"] for s in check.steps)
    report = {"steps": check.steps, "passed": passed, "total": len(check.steps),
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": "make service-check",
              "measured_with": {"commit": measured_at, "command": "make service-check",
                                "guide_blocks": ["build", "server-install", "coordinator-service"],
                                "coordinator_toml": "the guide's, with the four commented changes of "
                                                    "coordinator_toml()"},
              "setup": "one systemd-nspawn container (Debian bookworm amd64, systemd as PID 1) holds the server and "
                       "the device; commands through nsenter as root"}
    report["measured_with"] = provenance.measured_with(report["command"], {},
                                                       note="the operator guide under systemd; no federation")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "service_check.json").write_text(json.dumps(report, indent=1) + "\n")
    echo(f"{passed}/{len(check.steps)} steps passed; wrote {RESULTS / 'service_check.json'}; transcript in "
         f"{logs / 'transcript.log'}")
    return 0 if passed == len(check.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
