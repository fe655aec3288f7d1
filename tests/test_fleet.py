"""Fleet emulation (broker_coordinator/simulation/fleet.py): device classes, cgroups, churn; and one small
`simulate --fleet --churn` run with real agent processes under real kernel limits (as root)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker_coordinator.simulation import fleet
from broker_coordinator.simulation.simulate import SimulationSpec, setup_fleet

ROOT = Path(__file__).resolve().parent.parent


def test_parse_and_assign():
    assert fleet.parse_fleet("zero2w:4,pi5:2") == [("zero2w", 4), ("pi5", 2)]
    classes = fleet.assign("zero2w:2,pi3:1,pi4:1,pi5:2", 6, seed=3)
    assert sorted(c.name for c in classes) == ["pi3", "pi4", "pi5", "pi5", "zero2w", "zero2w"]
    assert classes == fleet.assign("zero2w:2,pi3:1,pi4:1,pi5:2", 6, seed=3)  # the seed decides
    for bad, words in [("pi9:2", "unknown device class"), ("pi4:x", "integer"), ("pi4:0", "at least 1")]:
        with pytest.raises(ValueError, match=words):
            fleet.parse_fleet(bad)
    with pytest.raises(ValueError, match="--agents is 5"):
        fleet.assign("pi4:2", 5, 0)


def test_profiles_are_ordered_and_the_default_scale_fits_the_host():
    speeds = [fleet.PROFILES[n].speed for n in ("zero2w", "pi3", "pi4", "pi5")]
    assert speeds == sorted(speeds) and speeds[-1] == 1.0
    classes = fleet.assign("zero2w:4,pi3:4,pi4:8,pi5:4", 20, 0)
    scale = fleet.default_cpu_scale(classes, host_cores=2)
    assert sum(c.speed * scale for c in classes) == pytest.approx(4.0)
    assert fleet.default_cpu_scale(classes[:2], host_cores=64) == 1.0  # never above one core per agent
    assert fleet.PROFILES["zero2w"].memory_limit_mb == 512 - fleet.OS_RESERVE_MB


def test_churn_schedule_is_reproducible_and_near_its_fraction():
    devices = [f"d{i}" for i in range(20)]
    a = fleet.churn_schedule(devices, 0.2, 10.0, 2000.0, seed=1)
    assert a == fleet.churn_schedule(devices, 0.2, 10.0, 2000.0, seed=1)
    assert a != fleet.churn_schedule(devices, 0.2, 10.0, 2000.0, seed=2)
    offline = sum(o.seconds for o in a) / (len(devices) * 2000.0)
    assert 0.12 < offline < 0.3
    assert {o.mode for o in a} == {"restart", "freeze"}
    with pytest.raises(ValueError, match="FRACTION"):
        fleet.parse_churn("a lot")
    assert fleet.parse_churn("0.1") == (0.1, 30.0)


def wait_for_state(pid: int, stopped: bool, timeout: float = 5.0) -> bool:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if (state in ("T", "t")) == stopped:
            return True
        time.sleep(0.05)
    return False


def test_churn_freezes_and_restarts_real_processes():
    started: list[str] = []

    def respawn(device: str) -> subprocess.Popen:
        started.append(device)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    processes = {d: respawn(d) for d in ("a", "b")}
    started.clear()
    schedule = [fleet.Outage("a", 0.0, 0.6, "restart"), fleet.Outage("b", 0.0, 0.6, "freeze")]
    churn = fleet.Churn(schedule, processes, respawn, echo=lambda line: None)
    try:
        churn.start()
        deadline = time.monotonic() + 5
        while churn.offline() != {"a", "b"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert churn.offline() == {"a", "b"}
        assert wait_for_state(processes["b"].pid, stopped=True)
        while churn.offline() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started == ["a"] and processes["a"].poll() is None  # restarted
        assert wait_for_state(processes["b"].pid, stopped=False)
        assert [e["mode"] for e in churn.events] == ["restart", "freeze"]
    finally:
        churn.stop()
        for p in processes.values():
            p.kill()
            p.wait()


def test_without_cgroup_rights_one_line_and_the_run_goes_on(tmp_path, monkeypatch):
    with pytest.raises(fleet.CgroupUnavailable, match="no cgroup v2 at .* and no v1 cpu and memory"):
        fleet.Cgroups("x", root=tmp_path)

    def refuse(run_name):
        raise fleet.CgroupUnavailable("creating cgroups needs root (running as uid 1000)")

    monkeypatch.setattr(fleet, "Cgroups", refuse)
    lines: list[str] = []
    groups, procs, classes = setup_fleet(SimulationSpec(agents=2, fleet="pi3:1,pi5:1"), ["d0", "d1"], "x",
                                         lines.append)
    assert groups is None and procs == {} and sorted(classes.values()) == ["pi3", "pi5"]
    assert lines == ["fleet emulation off: creating cgroups needs root (running as uid 1000); "
                     "agents run without CPU quota or memory limit"]


def real_cgroups(name: str) -> fleet.Cgroups:
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root; this test runs a quota'd process for real")
    try:
        return fleet.Cgroups(name)
    except fleet.CgroupUnavailable as exc:
        pytest.skip(f"no usable cgroups here: {exc}")


def test_a_process_in_its_cgroup_sees_its_quota_and_limit_like_under_systemd():
    groups = real_cgroups(f"edgefl-test-{os.getpid()}")
    try:
        procs = groups.limit("dev-x", 0.3, 700)
        probe = "from edge_agent import hardware, limits; import json; print(json.dumps(hardware.probe()))"
        argv = fleet.join_command(procs, [sys.executable, "-c", probe])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
        assert out.returncode == 0, out.stderr
        profile = json.loads(out.stdout)
        assert profile["cpu_quota"] == 0.3 and profile["cores"] == 1
        assert profile["memory_limit_mb"] == 700 and profile["memory_mb"] == 700
    finally:
        groups.remove()
    assert not any(p.exists() for p in groups.created)


def test_simulate_on_an_emulated_fleet_with_churn(tmp_path):
    """Four agent processes (one per class) under real quotas, churn on, device-chosen epochs."""
    out = tmp_path / "out"
    # --fleet-cpu 3: the same ratios at 3x the CPU (zero2w 0.33 cores), so the test spends little time importing torch
    args = [sys.executable, "-m", "broker_coordinator", "simulate", "--agents", "4", "--rounds", "3",
            "--dataset", "digits", "--fleet", "zero2w:1,pi3:1,pi4:1,pi5:1", "--fleet-cpu", "3", "--churn", "0.2:3",
            "--local-epochs", "0", "--round-timeout", "15", "--seed", "1", "--out", str(out)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "fleet: " in result.stdout or "fleet emulation off: " in result.stdout
    history = json.loads((out / "history.json").read_text())
    meta = history["meta"]
    assert sorted(meta["device_classes"].values()) == ["pi3", "pi4", "pi5", "zero2w"]
    assert meta["fleet_limits"] == (os.geteuid() == 0)
    assert len(history["rounds"]) == 3
    for r in history["rounds"]:
        assert set(r["devices"]) <= set(r["cohort"])
        assert all(d["device_class"] in fleet.PROFILES for d in r["devices"].values())
    assert not any(p.name.startswith("edgefl-sim-") for p in Path("/sys/fs/cgroup/cpu").glob("edgefl-sim-*"))
