"""An emulated mixed fleet for `simulate`: device classes as real kernel limits, and churn.

`--fleet zero2w:4,pi3:4,pi4:8,pi5:4` puts each agent process into a cgroup of
its own with a CPU quota (cfs quota on cgroup v1, cpu.max on v2) proportional
to its class's training speed and a memory limit from its class's RAM, the
way systemd's `CPUQuota=` and `MemoryMax=` would on a device. The agent's
probe reads them back (edge_agent/limits.py), so its calibration, its
hardware-aware epochs and the deadlines meet the same heterogeneity.

Relative training speed (one thread, small CNN; Pi 5 = 1.0) and RAM, with
where each number comes from. They are estimates from published CPU
benchmarks, not measurements of PyTorch on the boards:
    pi5     1.00   Cortex-A76 x4 @ 2.4 GHz, 4 GB (the 4 GB model; 2/4/8 GB are sold).
    pi4     0.40   Cortex-A72 x4 @ 1.5-1.8 GHz, 2 GB (the 2 GB model). Raspberry Pi's Pi 5 launch post
                   (raspberrypi.com/news/introducing-raspberry-pi-5, Oct 2023) states "a 2-3x increase
                   in CPU performance relative to Raspberry Pi 4"; 1/2.5 = 0.40.
    pi3     0.16   Cortex-A53 x4 @ 1.4 GHz (3B+), 1 GB. The Pi 4 launch post (Jun 2019) cites "up to
                   three times" the 3B+'s speed; we use 2.5x for single-threaded float work: 0.40 / 2.5.
                   (Estimate: the A53 is in-order and its NEON throughput is roughly half the A72's
                   per clock, 1.4 vs 1.5 GHz.)
    zero2w  0.11   the 3B's SoC (RP3A0: Cortex-A53 x4) clocked at 1.0 GHz, 512 MB: pi3 x 1.0/1.4,
                   a clock-ratio estimate.
The memory limit is the board's RAM less what the OS keeps for itself (about
128 MB on Raspberry Pi OS Lite, an estimate), so a Zero 2 W agent gets 384 MB.

The CPU quota of a class is speed x `cpu_scale` cores; by default `cpu_scale`
is chosen so the whole fleet's quotas add up to twice this machine's cores
(with half the fleet selected per round, the busy agents can get their quota),
and never above one core (the agent trains on one thread). Quotas are
ceilings: other load on the host can give an agent less.

Churn (`--churn FRACTION[:SECONDS]`): each device alternates online and
offline periods, drawn from exponential distributions with the given mean
offline seconds and a mean online time that leaves FRACTION of the time
offline. Half the offline periods stop the process (SIGTERM) and start it
again afterwards (a reboot: the agent resumes from its state dir); the other
half freeze it (SIGSTOP, then SIGCONT: a device that drops off the network
mid-round and comes back with a late update). The schedule comes from the
seed alone.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("broker_coordinator.simulation.fleet")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
OS_RESERVE_MB = 128


@dataclass(frozen=True)
class DeviceClass:
    name: str
    speed: float  # training throughput relative to a Pi 5 (one thread)
    ram_mb: int

    @property
    def memory_limit_mb(self) -> int:
        return self.ram_mb - OS_RESERVE_MB


PROFILES: dict[str, DeviceClass] = {c.name: c for c in (
    DeviceClass("zero2w", 0.11, 512),
    DeviceClass("pi3", 0.16, 1024),
    DeviceClass("pi4", 0.40, 2048),
    DeviceClass("pi5", 1.00, 4096),
)}


def parse_fleet(spec: str) -> list[tuple[str, int]]:
    """'zero2w:4,pi5:2' -> [('zero2w', 4), ('pi5', 2)]; ValueError says what is wrong."""
    out = []
    for part in spec.split(","):
        name, sep, count = part.strip().partition(":")
        if name not in PROFILES:
            raise ValueError(f"unknown device class {name!r} in --fleet; choose from {', '.join(PROFILES)}")
        try:
            n = int(count) if sep else 1
        except ValueError:
            raise ValueError(f"--fleet {part!r}: the count after ':' must be an integer") from None
        if n < 1:
            raise ValueError(f"--fleet {part!r}: the count must be at least 1")
        out.append((name, n))
    if not out:
        raise ValueError("--fleet is empty; write e.g. zero2w:4,pi3:4,pi4:8,pi5:4")
    return out


def assign(spec: str, agents: int, seed: int) -> list[DeviceClass]:
    """One device class per agent, shuffled with the seed (so data size does not follow the class)."""
    classes = [PROFILES[name] for name, n in parse_fleet(spec) for _ in range(n)]
    if len(classes) != agents:
        raise ValueError(f"--fleet describes {len(classes)} devices but --agents is {agents}; make them equal")
    random.Random(f"fleet/{seed}").shuffle(classes)
    return classes


def default_cpu_scale(classes: list[DeviceClass], host_cores: int | None = None) -> float:
    host_cores = host_cores or os.cpu_count() or 1
    return min(1.0, 2.0 * host_cores / sum(c.speed for c in classes))


def parse_churn(spec: str) -> tuple[float, float]:
    """'0.15' or '0.15:30' -> (offline fraction, mean offline seconds)."""
    fraction, _, seconds = spec.partition(":")
    try:
        f, s = float(fraction), float(seconds or 30.0)
    except ValueError:
        raise ValueError(f"--churn {spec!r}: write FRACTION[:SECONDS], e.g. 0.15:30") from None
    if not (0 < f < 1) or s <= 0:
        raise ValueError(f"--churn {spec!r}: the fraction must be in (0, 1) and the seconds positive")
    return f, s


# --- cgroups ---------------------------------------------------------------------------

class CgroupUnavailable(Exception):
    """The machine or our rights do not allow per-process limits; the message says what is missing."""


class Cgroups:
    """One cgroup per agent under a run-specific parent; v2 where /sys/fs/cgroup is unified, else v1
    (cpu and memory hierarchies). Only the directories this object created are removed."""

    def __init__(self, run_name: str, root: Path = CGROUP_ROOT) -> None:
        self.root = root
        self.created: list[Path] = []
        if (root / "cgroup.controllers").exists():
            self.version = 2
            self.parents = {"unified": self._v2_parent(run_name)}
        elif (root / "cpu").is_dir() and (root / "memory").is_dir():
            self.version = 1
            self.parents = {c: self._own(root / c, c) / run_name for c in ("cpu", "memory")}
        else:
            raise CgroupUnavailable(f"no cgroup v2 at {root} and no v1 cpu and memory hierarchies under it")
        if os.geteuid() != 0:
            raise CgroupUnavailable(f"creating cgroups needs root (running as uid {os.geteuid()})")
        for parent in self.parents.values():
            self._mkdir(parent)
        if self.version == 2:
            self._write(self.parents["unified"] / "cgroup.subtree_control", "+cpu +memory")

    def _own(self, mount: Path, controller: str) -> Path:
        """Nest under this process's own cgroup of that controller, so limits set above us still hold."""
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                if controller in controllers.split(","):
                    candidate = mount / path.lstrip("/")
                    return candidate if candidate.is_dir() else mount
        except (OSError, ValueError):
            pass
        return mount

    def _v2_parent(self, run_name: str) -> Path:
        own = self._own(self.root, "")
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = self.root / line[3:].lstrip("/")
        return own / run_name

    def _mkdir(self, path: Path) -> None:
        try:
            path.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create cgroup {path}: {exc.strerror}") from None
        self.created.append(path)

    def _write(self, path: Path, text: str) -> None:
        try:
            path.write_text(text)
        except OSError as exc:
            raise CgroupUnavailable(f"cannot write {text!r} to {path}: {exc.strerror}") from None

    def limit(self, name: str, cpu_cores: float, memory_mb: int) -> list[Path]:
        """Create the agent's cgroup with its limits; returns the cgroup.procs files its process joins."""
        quota = max(1000, int(cpu_cores * CFS_PERIOD_US))
        memory = str(memory_mb * 2**20)
        if self.version == 2:
            group = self.parents["unified"] / name
            self._mkdir(group)
            self._write(group / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            self._write(group / "memory.max", memory)
            return [group / "cgroup.procs"]
        cpu, mem = self.parents["cpu"] / name, self.parents["memory"] / name
        self._mkdir(cpu)
        self._mkdir(mem)
        self._write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        self._write(cpu / "cpu.cfs_quota_us", str(quota))
        self._write(mem / "memory.limit_in_bytes", memory)
        return [cpu / "cgroup.procs", mem / "cgroup.procs"]

    def share(self, parent: str, name: str, weight: int) -> list[Path]:
        """A group inside `parent` (made by `limit`) with systemd's CPUWeight `weight` (1-10000, 100 the
        default) against its siblings, under the parent's quota and memory; the procs files to join."""
        if self.version == 2:
            group = self.parents["unified"] / parent / name
            self._write(group.parent / "cgroup.subtree_control", "+cpu")
            self._mkdir(group)
            self._write(group / "cpu.weight", str(weight))
            return [group / "cgroup.procs"]
        group = self.parents["cpu"] / parent / name
        self._mkdir(group)
        self._write(group / "cpu.shares", str(max(2, weight * 1024 // 100)))
        return [group / "cgroup.procs", self.parents["memory"] / parent / "cgroup.procs"]

    def throttled_seconds(self, name: str) -> float | None:
        """CPU time the kernel withheld from the agent (v1 cpu.stat throttled_time, v2 throttled_usec)."""
        group = self.parents.get("cpu", self.parents.get("unified"))
        try:
            stats = dict(line.split() for line in (group / name / "cpu.stat").read_text().splitlines())
        except (OSError, ValueError):
            return None
        if "throttled_time" in stats:
            return int(stats["throttled_time"]) / 1e9
        if "throttled_usec" in stats:
            return int(stats["throttled_usec"]) / 1e6
        return None

    def remove(self) -> None:
        for path in reversed(self.created):  # children before parents; only what we made
            for _ in range(20):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # the last process is still leaving the group


def join_command(procs_files: list[Path], argv: list[str]) -> list[str]:
    """argv run by a shell that first moves itself into the cgroups, then execs: the agent starts limited."""
    joins = " && ".join(f'echo $$ > "{p}"' for p in procs_files)
    return ["/bin/sh", "-c", f'{joins} && exec "$@"', "edgefl-agent", *argv]


# --- churn -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Outage:
    device: str
    start: float  # seconds after the churn starts
    seconds: float
    mode: str  # "restart" (SIGTERM, started again) or "freeze" (SIGSTOP, then SIGCONT)


def churn_schedule(devices: list[str], fraction: float, mean_offline: float, horizon: float,
                   seed: int) -> list[Outage]:
    """Alternating exponential online / offline periods per device, from the seed alone."""
    rng = random.Random(f"churn/{seed}")
    mean_online = mean_offline * (1 - fraction) / fraction
    outages = []
    for device in devices:
        t = rng.expovariate(1 / mean_online)
        while t < horizon:
            seconds = max(1.0, rng.expovariate(1 / mean_offline))
            outages.append(Outage(device, t, seconds, rng.choice(["restart", "freeze"])))
            t += seconds + rng.expovariate(1 / mean_online)
    return sorted(outages, key=lambda o: o.start)


class Churn:
    """Plays a schedule against the agent processes on a thread of its own; `stop()` brings every
    device back (frozen ones are continued, stopped ones started) so the run ends cleanly."""

    def __init__(self, schedule: list[Outage], processes: dict[str, subprocess.Popen],
                 respawn: Callable[[str], subprocess.Popen], echo: Callable[[str], None] = print) -> None:
        self.schedule, self.processes, self.respawn, self.echo = schedule, processes, respawn, echo
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.down: dict[str, str] = {}  # device -> mode, while offline
        self.events: list[dict] = []
        self.thread = threading.Thread(target=self._run, name="churn", daemon=True)

    def start(self) -> None:
        self.started = time.monotonic()
        self.thread.start()

    def _run(self) -> None:
        pending: list[tuple[float, str, Outage]] = [(o.start, "down", o) for o in self.schedule]
        pending.sort(key=lambda e: e[0])
        while pending and not self.stopping.is_set():
            at, what, outage = pending[0]
            wait = self.started + at - time.monotonic()
            if wait > 0:
                self.stopping.wait(min(wait, 0.5))
                continue
            pending.pop(0)
            if what == "down":
                if self._down(outage):
                    pending.append((at + outage.seconds, "up", outage))
                    pending.sort(key=lambda e: e[0])
            else:
                self._up(outage.device)

    def _down(self, outage: Outage) -> bool:
        with self.lock:
            process = self.processes.get(outage.device)
            if outage.device in self.down or process is None or process.poll() is not None:
                return False
            if outage.mode == "freeze":
                process.send_signal(signal.SIGSTOP)
            else:
                process.terminate()
            self.down[outage.device] = outage.mode
            self.events.append({"device": outage.device, "mode": outage.mode, "at": round(outage.start, 1),
                                "seconds": round(outage.seconds, 1)})
        log.info("churn: %s offline for %.0f s (%s)", outage.device, outage.seconds, outage.mode)
        return True

    def _up(self, device: str) -> None:
        with self.lock:
            mode = self.down.pop(device, None)
            process = self.processes.get(device)
            if mode is None or process is None:
                return
            if mode == "freeze":
                process.send_signal(signal.SIGCONT)
            else:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                self.processes[device] = self.respawn(device)
        log.info("churn: %s back (%s)", device, mode)

    def offline(self) -> set[str]:
        with self.lock:
            return set(self.down)

    def stop(self) -> None:
        """End the churn: frozen processes are continued (so they can be stopped); stopped ones stay down."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=35)
        with self.lock:
            for device, mode in list(self.down.items()):
                process = self.processes.get(device)
                if mode == "freeze" and process is not None and process.poll() is None:
                    process.send_signal(signal.SIGCONT)
            self.down.clear()
