"""The agent reads its cgroup's CPU quota and memory limit (edge_agent/limits.py), from fake
/proc and /sys trees here, and from a real cgroup in tests/test_fleet.py."""

from pathlib import Path

from edge_agent import limits

V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTINFO = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v1_tree(root: Path, quota: str = "50000", memory: str = str(400 * 2**20)) -> None:
    write(root, "proc/self/mountinfo", V1_MOUNTINFO)
    write(root, "proc/self/cgroup", "4:memory:/edgefl/dev-1\n2:cpu,cpuacct:/edgefl/dev-1\n0::/\n")
    write(root, "sys/fs/cgroup/cpu,cpuacct/edgefl/dev-1/cpu.cfs_quota_us", quota)
    write(root, "sys/fs/cgroup/cpu,cpuacct/edgefl/dev-1/cpu.cfs_period_us", "100000")
    write(root, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1")
    write(root, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000")
    write(root, "sys/fs/cgroup/memory/edgefl/dev-1/memory.limit_in_bytes", memory)
    write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712")


def test_v1_quota_and_memory_limit(tmp_path):
    v1_tree(tmp_path)
    got = limits.read(tmp_path)
    assert got == limits.Limits(cpu_quota=0.5, memory_bytes=400 * 2**20, version=1)


def test_v1_no_limits_reads_as_none(tmp_path):
    v1_tree(tmp_path, quota="-1", memory="9223372036854771712")
    assert limits.read(tmp_path) == limits.Limits()


def test_a_parent_limit_applies_when_it_is_smaller(tmp_path):
    v1_tree(tmp_path, quota="-1")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/edgefl/cpu.cfs_quota_us", "25000")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/edgefl/cpu.cfs_period_us", "100000")
    assert limits.read(tmp_path).cpu_quota == 0.25


def test_v2_like_systemd_cpuquota_and_memorymax(tmp_path):
    # CPUQuota=150% and MemoryMax=1G in a unit are written by systemd as below
    write(tmp_path, "proc/self/mountinfo", V2_MOUNTINFO)
    write(tmp_path, "proc/self/cgroup", "0::/system.slice/edge-agent.service\n")
    write(tmp_path, "sys/fs/cgroup/system.slice/edge-agent.service/cpu.max", "150000 100000")
    write(tmp_path, "sys/fs/cgroup/system.slice/edge-agent.service/memory.max", str(2**30))
    write(tmp_path, "sys/fs/cgroup/system.slice/cpu.max", "max 100000")
    write(tmp_path, "sys/fs/cgroup/system.slice/memory.max", "max")
    assert limits.read(tmp_path) == limits.Limits(cpu_quota=1.5, memory_bytes=2**30, version=2)


def test_v2_without_limits(tmp_path):
    write(tmp_path, "proc/self/mountinfo", V2_MOUNTINFO)
    write(tmp_path, "proc/self/cgroup", "0::/user.slice\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/cpu.max", "max 100000")
    assert limits.read(tmp_path) == limits.Limits()


def test_missing_or_junk_files_mean_no_limits(tmp_path):
    assert limits.read(tmp_path) == limits.Limits()
    v1_tree(tmp_path, quota="lots", memory="")
    assert limits.read(tmp_path) == limits.Limits()


def test_apply_caps_the_profile_like_the_device_would_see_it():
    profile = {"cores": 4, "memory_mb": 8000, "memory_available_mb": 6000, "load1": 0.1}
    got = limits.apply(profile, limits.Limits(cpu_quota=0.3, memory_bytes=384 * 2**20, version=1))
    assert got["cores"] == 1 and got["cpu_quota"] == 0.3
    assert got["memory_mb"] == 384 and got["memory_available_mb"] == 384 and got["memory_limit_mb"] == 384
    assert limits.apply(profile, limits.Limits()) == profile
    assert limits.apply(profile, limits.Limits(cpu_quota=2.5))["cores"] == 3
