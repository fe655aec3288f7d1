"""Helpers for end-to-end tests: real agent processes with their own data files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from broker_coordinator.simulation.private_broker import PrivateBroker
from broker_coordinator.simulation.processes import stop_processes
from edgefl_protocol import signing
from edgefl_protocol.settings import to_toml
from edgefl_models import datasets, partition

ROOT = Path(__file__).resolve().parent.parent


def write_agent(tmp: Path, broker: PrivateBroker, federation: str, device: str, data: datasets.Dataset,
                key: bytes | None = None) -> Path:
    home = tmp / device
    datasets.save_npz(home / "data.npz", data)
    config = home / "agent.toml"
    config.write_text(to_toml({
        "broker": {"host": broker.host, "port": broker.port, "username": device, "password": broker.users[device]},
        "device": {"id": device, "data": str(home / "data.npz"), "state_dir": str(home / "state"),
                   "federation": federation, "threads": 1, "signing_key": key.hex() if key else None},
    }))
    return config


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


class Fleet:
    """Agent processes on digits shards; `stop()` terminates exactly the processes it started."""

    def __init__(self, tmp: Path, broker: PrivateBroker, federation: str, devices: list[str], seed: int = 0):
        data = datasets.load("digits")
        self.test = data.test
        parts = partition.split("iid", data.train.y, len(devices), seed)
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.keys = {device: signing.new_key() for device in devices}  # update signing keys, one per device
        for device, index in zip(devices, parts):
            config = write_agent(tmp, broker, federation, device, data.train.subset(index), self.keys[device])
            self.logs[device] = config.parent / "agent.log"
            self.processes[device] = spawn(["-m", "edge_agent", "run", "--config", str(config)], self.logs[device])

    def kill(self, device: str) -> None:
        self.processes[device].send_signal(signal.SIGKILL)
        self.processes[device].wait()

    def stop(self) -> None:
        stop_processes(self.processes.values())


def write_test_set(path: Path, data: datasets.Dataset) -> Path:
    np.savez(path, x=data.x, y=data.y)
    return path


def simulate_with_config(tmp: Path, config_text: str, agents: int = 3, rounds: int = 2,
                         dataset: str = "digits") -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`broker-coordinator simulate --config FILE` as a user runs it: its output and history.json's rounds."""
    config = tmp / "sim.toml"
    config.write_text(config_text)
    out = tmp / "out"
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--agents", str(agents),
                             "--rounds", str(rounds), "--dataset", dataset, "--out", str(out), "--config", str(config)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    return result, json.loads((out / "history.json").read_text())["rounds"]
