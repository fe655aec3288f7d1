"""The CPU quota and memory limit the kernel enforces on this process (cgroups).

On a device the agent's systemd unit may say `CPUQuota=50%` or
`MemoryMax=400M`; systemd writes those into the unit's cgroup, and a fleet
emulated by `broker-coordinator simulate --fleet` does the same by hand. The
agent's hardware probe should see what the kernel will actually give it, not
the host's cores and RAM, so hardware-aware epochs and deadlines are planned
against the real budget.

Both cgroup versions are read:
    v2  (one unified hierarchy)  cpu.max "QUOTA PERIOD" or "max PERIOD", memory.max "BYTES" or "max"
    v1  (one hierarchy per controller)  cpu.cfs_quota_us (-1 = none) / cpu.cfs_period_us,
        memory.limit_in_bytes (a huge number = none)
The effective limit is the smallest one on the path from the process's cgroup
up to the root of the mounted hierarchy (a parent slice can limit harder than
the unit). Everything is read from files; `root` lets tests point it at fake ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NO_LIMIT_BYTES = 1 << 60  # v1 reports "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class Limits:
    cpu_quota: float | None = None  # cores' worth of CPU time per period, e.g. 0.5; None = unlimited
    memory_bytes: int | None = None  # None = unlimited
    version: int = 0  # 1 or 2 when a cgroup was read, 0 when none was found

    def as_profile(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        if self.cpu_quota is not None:
            out["cpu_quota"] = round(self.cpu_quota, 3)
        if self.memory_bytes is not None:
            out["memory_limit_mb"] = round(self.memory_bytes / 2**20)
        return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _mounts(mountinfo: str) -> tuple[str | None, dict[str, tuple[str, str]]]:
    """(v2 mount point, {v1 controller: (mount point, root inside the hierarchy)}) from /proc/self/mountinfo."""
    v2, v1 = None, {}
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype = fields[3], fields[4], tail[0]
        if fstype == "cgroup2" and v2 is None:
            v2 = point
        elif fstype == "cgroup":
            for option in tail[2].split(","):
                if option in ("cpu", "memory"):
                    v1.setdefault(option, (point, root))
    return v2, v1


def _memberships(proc_cgroup: str) -> tuple[str | None, dict[str, str]]:
    """(v2 path, {v1 controller: path}) from /proc/self/cgroup."""
    v2, v1 = None, {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        for controller in controllers.split(","):
            if controller in ("cpu", "memory"):
                v1[controller] = path
    return v2, v1


def _chain(mount: str, hierarchy_root: str, path: str, root: Path) -> list[Path]:
    """The process's cgroup directory and its ancestors up to the mount point, innermost first."""
    relative = path
    if hierarchy_root not in ("/", "") and path.startswith(hierarchy_root):
        relative = path[len(hierarchy_root):]  # the mount shows a sub-tree (a cgroup namespace or bind mount)
    base = root / mount.lstrip("/")
    parts = [p for p in relative.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v1_cpu(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _v2_cpu(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    try:
        return int(quota) / int(period or "100000") if quota != "max" else None
    except (ValueError, ZeroDivisionError):
        return None


def _memory(directory: Path, name: str) -> int | None:
    text = _read(directory / name)
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < NO_LIMIT_BYTES else None


def _smallest(values) -> float | int | None:  # noqa: ANN001
    present = [v for v in values if v is not None]
    return min(present) if present else None


def read(root: Path | str = "/") -> Limits:
    """The effective CPU quota and memory limit of this process; Limits() when no cgroup says so."""
    root = Path(root)
    mountinfo = _read(root / "proc/self/mountinfo")
    proc_cgroup = _read(root / "proc/self/cgroup")
    if mountinfo is None or proc_cgroup is None:
        return Limits()
    v2_mount, v1_mounts = _mounts(mountinfo)
    v2_path, v1_paths = _memberships(proc_cgroup)
    if "cpu" in v1_mounts or "memory" in v1_mounts:
        cpu = memory = None
        if "cpu" in v1_mounts and "cpu" in v1_paths:
            cpu = _smallest(_v1_cpu(d) for d in _chain(*v1_mounts["cpu"], v1_paths["cpu"], root))
        if "memory" in v1_mounts and "memory" in v1_paths:
            memory = _smallest(_memory(d, "memory.limit_in_bytes")
                               for d in _chain(*v1_mounts["memory"], v1_paths["memory"], root))
        if cpu is not None or memory is not None:
            return Limits(cpu, memory, 1)
    if v2_mount is not None and v2_path is not None:
        chain = _chain(v2_mount, "/", v2_path, root)
        cpu = _smallest(_v2_cpu(d) for d in chain)
        memory = _smallest(_memory(d, "memory.max") for d in chain)
        return Limits(cpu, memory, 2 if (cpu is not None or memory is not None) else 0)
    return Limits()


def apply(profile: dict, limits: Limits | None = None) -> dict:
    """The probe's profile as the kernel will enforce it: cores capped by the CPU quota (at least
    one), memory capped by the limit; the raw limits are added as cpu_quota / memory_limit_mb."""
    limits = read() if limits is None else limits
    out = dict(profile)
    if limits.cpu_quota is not None:
        out["cores"] = max(1, min(int(out.get("cores", os.cpu_count() or 1)), int(limits.cpu_quota + 0.999)))
    if limits.memory_bytes is not None:
        limit_mb = round(limits.memory_bytes / 2**20)
        for key in ("memory_mb", "memory_available_mb"):
            if key in out:
                out[key] = min(int(out[key]), limit_mb)
    out.update(limits.as_profile())
    return out
