"""Fault drill (a benchmark, not a test): does any update vanish without a reason?

    python -m bench.fault_drill            # writes bench/results/fault_drill.json and fault_drill.md
    python -m bench.fault_drill --seed 2   # another schedule of faults

A private Mosquitto, `broker-coordinator run` as its own process, 5 agent
processes (digits, MLP); while the rounds run, the broker is SIGKILLed and
restarted 3 times, the coordinator SIGKILLed once and restarted (it resumes
from its checkpoint), and 2 of the 5 agents are SIGKILLed for good, at
seeded random times. Then every update an agent trained is traced through
the agents' logs: each must end in one of the logged outcomes (accepted,
rejected with the coordinator's reason, superseded by a newer task, shutdown, or no
receipt before the deadline); an update with no outcome line from an agent
that was still alive is "lost without a logged reason". The target is zero.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import provenance

RESULTS = Path(__file__).resolve().parent / "results"
FED = "drill"
TRAINED = re.compile(r"round (\d+): trained")
OUTCOMES = {
    "accepted": re.compile(r"round (\d+): update accepted by the coordinator"),
    "rejected": re.compile(r"round (\d+): update rejected by the coordinator: (\w+)"),
    "superseded": re.compile(r"round (\d+): a new task arrived before the receipt for the update"),
    "no_receipt": re.compile(r"round (\d+): no receipt for the update before the deadline"),
    "shutdown": re.compile(r"round (\d+): shutting down before the coordinator's receipt for the update"),
}


@dataclass
class Trace:
    device: str
    trained: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    unexplained: list[int] = field(default_factory=list)  # rounds trained with no outcome line


def audit(device: str, log_text: str, alive: bool) -> Trace:
    """Match every 'trained' line of an agent's log with the outcome that follows it."""
    trace = Trace(device)
    open_round: int | None = None
    for line in log_text.splitlines():
        if m := TRAINED.search(line):
            if open_round is not None:
                trace.unexplained.append(open_round)
            open_round = int(m.group(1))
            trace.trained += 1
            continue
        for kind, pattern in OUTCOMES.items():
            if (m := pattern.search(line)) and open_round is not None and int(m.group(1)) == open_round:
                trace.outcomes[kind] = trace.outcomes.get(kind, 0) + 1
                if kind == "rejected":
                    trace.reasons[m.group(2)] = trace.reasons.get(m.group(2), 0) + 1
                open_round = None
    if open_round is not None and alive:  # a killed agent's last round died with it
        trace.unexplained.append(open_round)
    return trace


DRILL_ROUNDS = {"local_epochs": 3, "min_updates": 2, "round_timeout": 25, "max_attempts": 0}  # [rounds]


def drill(seed: int, rounds: int, workdir: Path) -> dict:
    from broker_coordinator.access.broker import COORDINATOR_USER
    from broker_coordinator.simulation.private_broker import PrivateBroker
    from broker_coordinator.simulation.processes import stop_processes
    from broker_coordinator.simulation.simulate import PROJECT_ROOT
    from edgefl_protocol import signing
    from edgefl_protocol.settings import to_toml
    from edgefl_models import datasets, partition

    rng = random.Random(seed)
    devices = [f"dev-{i}" for i in range(5)]
    broker = PrivateBroker(workdir / "broker", FED)
    coordinator_password = broker.add_user(COORDINATOR_USER)
    for d in devices:
        broker.add_user(d)
    data = datasets.load("digits")
    keys = {d: signing.new_key() for d in devices}
    state = workdir / "coordinator"
    state.mkdir(parents=True)
    signing.write_key_file(state / "device_keys.toml", keys)
    test = workdir / "test.npz"
    datasets.save_npz(test, data.test)
    env = {"PYTHONPATH": str(PROJECT_ROOT)}

    def spawn(args: list[str], log: Path) -> subprocess.Popen:
        import os
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **env}, cwd=PROJECT_ROOT)

    events: list[str] = []
    started = time.monotonic()
    with broker:
        config = workdir / "coordinator.toml"
        config.write_text(to_toml({
            "federation": {"name": FED, "model": "digits_mlp", "rounds": rounds, "test_data": str(test)},
            "broker": {"host": broker.host, "port": broker.port, "username": COORDINATOR_USER,
                       "password": coordinator_password},
            "rounds": DRILL_ROUNDS,
            "storage": {"state_dir": str(state)},
        }))
        agents: dict[str, subprocess.Popen] = {}
        logs: dict[str, Path] = {}
        for d, index in zip(devices, partition.split("iid", data.train.y, len(devices), seed)):
            home = workdir / d
            datasets.save_npz(home / "data.npz", data.train.subset(index))
            (home / "agent.toml").write_text(to_toml({
                "broker": {"host": broker.host, "port": broker.port, "username": d, "password": broker.users[d]},
                "device": {"id": d, "data": str(home / "data.npz"), "state_dir": str(home / "state"),
                           "federation": FED, "threads": 1, "signing_key": keys[d].hex()}}))
            logs[d] = home / "agent.log"
            agents[d] = spawn(["-m", "edge_agent", "run", "--config", str(home / "agent.toml"), "--log-level", "INFO"],
                              logs[d])
        run = ["-m", "broker_coordinator", "run", "--config", str(config)]
        coordinator = spawn(run, workdir / "coordinator.log")
        # the schedule: 3 broker kills, 1 coordinator kill, 2 agent kills, spread over the drill
        faults = (["broker"] * 3 + ["coordinator"] + ["agent"] * 2)
        rng.shuffle(faults)
        killed: list[str] = []
        try:
            for fault in faults:
                wait_rounds(state, rng.uniform(0.6, 1.6), coordinator, started)
                if fault == "broker":
                    broker.process.send_signal(signal.SIGKILL)
                    broker.process.wait()
                    time.sleep(rng.uniform(0.5, 2.0))
                    broker.start()
                elif fault == "coordinator":
                    coordinator.send_signal(signal.SIGKILL)
                    coordinator.wait()
                    time.sleep(rng.uniform(0.5, 2.0))
                    coordinator = spawn(run, workdir / "coordinator.log")
                else:
                    victim = rng.choice([d for d in devices if d not in killed])
                    agents[victim].send_signal(signal.SIGKILL)
                    agents[victim].wait()
                    killed.append(victim)
                    fault = f"agent {victim}"
                events.append(f"{time.monotonic() - started:6.1f} s: killed {fault}")
            coordinator.wait(timeout=max(60.0, 40.0 * rounds))
        finally:
            stop_processes([coordinator, *agents.values()])
    traces = [audit(d, logs[d].read_text(errors="replace"), d not in killed) for d in devices]
    coordinator_log = (workdir / "coordinator.log").read_text(errors="replace")
    finished = len(re.findall(r"^round +\d+/", coordinator_log, re.M))
    return {"seed": seed, "rounds": rounds, "rounds_finished": finished, "events": events, "killed_agents": killed,
            "seconds": round(time.monotonic() - started, 1),
            "updates_trained": sum(t.trained for t in traces),
            "outcomes": _sum(t.outcomes for t in traces), "rejection_reasons": _sum(t.reasons for t in traces),
            "lost_without_reason": sum(len(t.unexplained) for t in traces),
            "unexplained": {t.device: t.unexplained for t in traces if t.unexplained},
            "coordinator_rejections_logged": len(re.findall(r"update from \S+ rejected: ", coordinator_log))}


def wait_rounds(state: Path, rounds: float, coordinator: subprocess.Popen, started: float) -> None:
    """Sleep for about `rounds` rounds of progress (at least a little), reading the checkpoint's round."""
    from broker_coordinator.storage.store import Store
    store = Store(state, keep=0)
    try:
        first = _round(store)
        give_up = time.monotonic() + 30 * rounds + 10
        while time.monotonic() < give_up and coordinator.poll() is None and _round(store) < first + rounds:
            time.sleep(0.5)
    finally:
        store.close()


def _round(store) -> float:  # noqa: ANN001
    try:
        ckpt = store.load_checkpoint()
    except (ValueError, OSError):
        return 0.0
    return float(ckpt.round) if ckpt else 0.0


def _sum(dicts) -> dict[str, int]:  # noqa: ANN001
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fault_drill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edgefl-drill-") as tmp:
        result = drill(args.seed, args.rounds, Path(tmp))
    from broker_coordinator.settings.round_settings import RoundSettings
    result["measured_with"] = provenance.measured_with(
        provenance.invoked(), provenance.deciding(RoundSettings(**DRILL_ROUNDS)), data="digits (digits_mlp)",
        partition="iid", seeds=[args.seed])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fault_drill.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Fault drill (seed {result['seed']})", "", "Written by `python -m bench.fault_drill`.", "",
             *[f"- {e}" for e in result["events"]], "",
             f"Rounds finished: {result['rounds_finished']} of {result['rounds']} in {result['seconds']} s.",
             f"Updates trained by the agents: {result['updates_trained']}; outcomes logged: "
             f"{json.dumps(result['outcomes'])}; rejection reasons: {json.dumps(result['rejection_reasons'])}.",
             f"**Lost without a logged reason: {result['lost_without_reason']}** (target 0)."]
    (RESULTS / "fault_drill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["lost_without_reason"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
