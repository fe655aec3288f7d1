"""The upgrade drill (`make upgrade-drill`): a federation started on the previous release is upgraded
to this one while it runs. Writes bench/results/upgrade.json and upgrade.md.

The previous release is built from its tag (v0.1.0) in a temporary git worktree with a virtualenv of
its own (the same dependencies as this one's: a .pth file names this venv's site-packages, another
the worktree). A private Mosquitto (simulation/private_broker.py), `broker-coordinator run` as its
own process, and six agent processes (MNIST-5k, the CNN, one epoch, every device in every round) start on
0.1.0, with the coordinator config 0.1.0's guide writes. Then, as docs/OPERATOR.md's "Upgrading"
says: the coordinator is stopped (SIGTERM, at a random point of a round), its config gains the
pacing that keeps 0.1.0's back-to-back rounds, and this release's coordinator starts on the same
state directory; then five agents, one at a time, each stopped at a random point of a round and
started again on this release with the same config and state. The sixth stays on 0.1.0 (a device
nobody upgraded): it trains beside the others in protocol 1.

What is measured, from the coordinator's database and the agents' logs (bench/fault_drill.py's
audit: each update an agent trained ends in a logged outcome, or is lost without a reason):
rounds completed, repeated (checkpointed twice) and skipped (never completed), updates lost with
and without a logged reason, and the final accuracy against a run of the same federation that never
upgraded (0.1.0 throughout, same seed). Last, the coordinator stops serving protocol 1
(`[federation] min_protocol = 2`) for a few rounds: the 0.1.0 agent is left out, the operator is
told once, and neither side crashes.

    python -m bench.upgrade_drill                 # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import provenance  # noqa: E402
from bench.fault_drill import _sum, audit  # noqa: E402

FED = "upgrade"
DEVICES = [f"dev-{i}" for i in range(6)]
STAYS_OLD = "dev-5"  # nobody upgrades it
DATASET, MODEL = "mnist5k", "mnist_cnn"  # rounds of a few seconds: long enough to stop a process inside one
ROUNDS, EXTRA_ROUNDS = 24, 3
COORDINATOR_AT, FIRST_AGENT_AT, AGENT_EVERY = 4, 7, 3  # rounds after which each upgrade happens
ROUND_SETTINGS = {"local_epochs": 1, "min_updates": 5, "clients_per_round": 0, "round_timeout": 20.0}
BACK_TO_BACK = "\n[pacing]\ninterval = 0\npatience = 0\n"  # what 0.1.0 did; this release paces by default


@dataclass
class Release:
    name: str
    python: str
    cwd: Path  # `python -m` puts the cwd first on sys.path: each release runs from its own tree

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(self.cwd))
        with open(log, "ab") as out:
            return subprocess.Popen([self.python, *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)


@contextmanager
def previous_release(tag: str, workdir: Path) -> Iterator[Release]:
    """The tag's tree in a git worktree, with a virtualenv of its own."""
    tree = workdir / f"edgefl-{tag}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), tag], check=True,
                   capture_output=True)
    try:
        venv = workdir / f"venv-{tag}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
        (site / "edgefl-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch, numpy, ...
        (site / f"edgefl-{tag}.pth").write_text(str(tree) + "\n")
        yield Release(tag.lstrip("v"), str(venv / "bin" / "python"), tree)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


@dataclass
class Federation:
    workdir: Path
    seed: int
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    coordinator: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        from broker_coordinator.access.broker import COORDINATOR_USER
        from broker_coordinator.simulation.private_broker import PrivateBroker

        self.broker = PrivateBroker(self.workdir / "broker", FED)
        self.password = self.broker.add_user(COORDINATOR_USER)
        for d in DEVICES:
            self.broker.add_user(d)

    def write_configs(self) -> None:
        """The coordinator's and the agents' configs, once the broker listens (its port)."""
        from broker_coordinator.access.broker import COORDINATOR_USER
        from edgefl_protocol import signing
        from edgefl_protocol.settings import to_toml
        from edgefl_models import datasets, partition

        data = datasets.load(DATASET)
        keys = {d: signing.new_key() for d in DEVICES}
        self.state = self.workdir / "coordinator"
        self.state.mkdir(parents=True)
        signing.write_key_file(self.state / "device_keys.toml", keys)  # a fleet provisioned by hand
        datasets.save_npz(self.workdir / "test.npz", data.test)
        self.config = self.workdir / "coordinator.toml"
        self.config.write_text(to_toml({  # the keys 0.1.0 knows
            "federation": {"name": FED, "model": MODEL, "rounds": ROUNDS, "test_data": str(self.workdir / "test.npz"),
                           "seed": self.seed},
            "broker": {"host": self.broker.host, "port": self.broker.port, "username": COORDINATOR_USER,
                       "password": self.password},
            "rounds": ROUND_SETTINGS, "storage": {"state_dir": str(self.state)}}))
        for d, index in zip(DEVICES, partition.split("iid", data.train.y, len(DEVICES), self.seed)):
            home = self.workdir / d
            datasets.save_npz(home / "data.npz", data.train.subset(index))
            (home / "agent.toml").write_text(to_toml({
                "broker": {"host": self.broker.host, "port": self.broker.port, "username": d,
                           "password": self.broker.users[d]},
                "device": {"id": d, "data": str(home / "data.npz"), "state_dir": str(home / "state"),
                           "federation": FED, "threads": 1, "signing_key": keys[d].hex()}}))

    def start_agent(self, device: str, release: Release) -> None:
        home = self.workdir / device
        self.agents[device] = release.start(["-m", "edge_agent", "run", "--config", str(home / "agent.toml")],
                                            home / "agent.log")

    def start_coordinator(self, release: Release) -> None:
        self.coordinator = release.start(["-m", "broker_coordinator", "run", "--config", str(self.config)],
                                         self.workdir / "coordinator.log")

    def round(self) -> int:
        """The last round the coordinator checkpointed (its database, as either release writes it)."""
        try:
            db = sqlite3.connect(f"file:{self.state / 'coordinator.db'}?mode=ro", uri=True, timeout=5)
            try:
                row = db.execute("SELECT MAX(round) FROM rounds WHERE closed IN ('complete', 'deadline')").fetchone()
            finally:
                db.close()
        except sqlite3.Error:
            return 0
        return int(row[0] or 0)

    def wait_for_round(self, n: int, timeout: float = 600.0) -> None:
        give_up = time.monotonic() + timeout
        while self.round() < n:
            if self.coordinator is not None and self.coordinator.poll() is not None and self.round() < n:
                raise RuntimeError(f"the coordinator exited ({self.coordinator.returncode}) before round {n}: "
                                   + (self.workdir / "coordinator.log").read_text()[-3000:])
            if time.monotonic() > give_up:
                raise TimeoutError(f"round {n} not reached in {timeout:.0f} s (at {self.round()})")
            time.sleep(0.2)

    def stop(self, process: subprocess.Popen) -> None:
        process.send_signal(signal.SIGTERM)  # what systemctl stop does
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def rounds_table(self) -> list[tuple[int, str, float | None]]:
        db = sqlite3.connect(self.state / "coordinator.db")
        try:
            return db.execute("SELECT round, closed, accuracy FROM rounds ORDER BY rowid").fetchall()
        finally:
            db.close()


def at_a_random_point_of_a_round(fed: Federation, after: int, rng: random.Random) -> None:
    """Wait for round `after` (at most the third-last: rounds do not wait for the drill), measure the
    next round's length, then wait a random fraction of a round into the one after it."""
    fed.wait_for_round(min(after, ROUNDS - 3))
    begun = fed.round()
    started = time.monotonic()
    fed.wait_for_round(begun + 1)
    time.sleep(rng.uniform(0.0, time.monotonic() - started))


def drill(old: Release, new: Release, seed: int, workdir: Path, upgrade: bool) -> dict:
    rng = random.Random(seed)
    fed = Federation(workdir, seed)
    events: list[str] = []
    started = time.monotonic()
    with fed.broker:
        fed.write_configs()
        for d in DEVICES:
            fed.start_agent(d, old)
        fed.start_coordinator(old)
        try:
            if upgrade:
                at_a_random_point_of_a_round(fed, COORDINATOR_AT, rng)
                at = fed.round()
                fed.stop(fed.coordinator)
                fed.config.write_text(fed.config.read_text() + BACK_TO_BACK)
                fed.start_coordinator(new)
                events.append(f"{time.monotonic() - started:6.1f} s: coordinator upgraded after round {at}")
                for i, device in enumerate(d for d in DEVICES if d != STAYS_OLD):
                    at_a_random_point_of_a_round(fed, FIRST_AGENT_AT + i * AGENT_EVERY, rng)
                    at = fed.round()
                    fed.stop(fed.agents[device])
                    fed.start_agent(device, new)
                    events.append(f"{time.monotonic() - started:6.1f} s: {device} upgraded after round {at}")
            fed.wait_for_round(ROUNDS)
            fed.coordinator.wait(timeout=120)
            table = fed.rounds_table()
            coordinator_log = (workdir / "coordinator.log").read_text(errors="replace")
            result = {"seconds": round(time.monotonic() - started, 1), "events": events,
                      **round_accounting(table), **update_accounting(workdir)}
            if upgrade:
                result["min_protocol_2"] = stop_serving_protocol_1(fed, new, coordinator_log)
        finally:
            from broker_coordinator.simulation.processes import stop_processes
            stop_processes([p for p in [fed.coordinator, *fed.agents.values()] if p is not None])
    return result


def round_accounting(table: list[tuple[int, str, float | None]]) -> dict:
    done = [r for r, closed, _ in table if closed in ("complete", "deadline")]
    counts = {r: done.count(r) for r in set(done)}
    final = [acc for r, closed, acc in table if closed in ("complete", "deadline") and r == ROUNDS]
    return {"rounds_completed": len(counts), "rounds_repeated": sum(n - 1 for n in counts.values()),
            "rounds_skipped": sum(1 for r in range(1, ROUNDS + 1) if r not in counts),
            "final_accuracy": final[-1] if final else None,
            "attempts_abandoned": sum(1 for _, closed, _ in table if closed not in ("complete", "deadline"))}


def update_accounting(workdir: Path) -> dict:
    traces = [audit(d, (workdir / d / "agent.log").read_text(errors="replace"), True) for d in DEVICES]
    outcomes = _sum(t.outcomes for t in traces)
    return {"updates_trained": sum(t.trained for t in traces), "outcomes": outcomes,
            "rejection_reasons": _sum(t.reasons for t in traces),
            "updates_lost_with_reason": sum(n for kind, n in outcomes.items() if kind != "accepted"),
            "updates_lost_without_reason": sum(len(t.unexplained) for t in traces),
            "unexplained": {t.device: t.unexplained for t in traces if t.unexplained}}


def stop_serving_protocol_1(fed: Federation, new: Release, before: str) -> dict:
    """A few more rounds with [federation] min_protocol = 2: the 0.1.0 agent is left out."""
    text = fed.config.read_text().replace(f"rounds = {ROUNDS}", f"rounds = {ROUNDS + EXTRA_ROUNDS}")
    fed.config.write_text(text.replace("[federation]", "[federation]\nmin_protocol = 2", 1))
    fed.start_coordinator(new)
    fed.wait_for_round(ROUNDS + EXTRA_ROUNDS)
    fed.coordinator.wait(timeout=120)
    log = (fed.workdir / "coordinator.log").read_text(errors="replace")[len(before):]
    db = sqlite3.connect(fed.state / "coordinator.db")
    try:
        tasked = db.execute("SELECT COUNT(*) FROM device_rounds WHERE device = ? AND round > ?",
                            (STAYS_OLD, ROUNDS)).fetchone()[0]
    finally:
        db.close()
    return {"rounds": EXTRA_ROUNDS, "old_agent_answers": tasked,
            "operator_warnings": len(re.findall(rf"WARNING .*{STAYS_OLD} runs an agent that speaks protocol", log)),
            "old_agent_alive": fed.agents[STAYS_OLD].poll() is None,
            "coordinator_exit": fed.coordinator.returncode,
            "warning": next((line for line in log.splitlines() if f"{STAYS_OLD} runs an agent" in line), "")}


def markdown(result: dict) -> str:
    u, b = result["upgraded"], result["never_upgraded"]
    m = u.get("min_protocol_2", {})
    rows = [("rounds completed", u["rounds_completed"], b["rounds_completed"]),
            ("rounds repeated", u["rounds_repeated"], b["rounds_repeated"]),
            ("rounds skipped", u["rounds_skipped"], b["rounds_skipped"]),
            ("round attempts abandoned (and retried)", u["attempts_abandoned"], b["attempts_abandoned"]),
            ("updates trained", u["updates_trained"], b["updates_trained"]),
            ("updates lost with a logged reason", u["updates_lost_with_reason"], b["updates_lost_with_reason"]),
            ("updates lost without a logged reason", u["updates_lost_without_reason"], b["updates_lost_without_reason"]),
            ("final accuracy", f"{u['final_accuracy']:.4f}", f"{b['final_accuracy']:.4f}")]
    lines = [f"# Upgrade drill: {result['from_version']} to {result['to_version']} while the federation runs", "",
             f"`{result['measured_with'].get('command', 'make upgrade-drill')}`; {len(DEVICES)} devices, {ROUNDS} "
             f"rounds; the coordinator upgraded first, then five agents one by one, each stopped at a random point "
             f"of a round; {STAYS_OLD} stays on {result['from_version']}.", "",
             "| | upgraded while running | never upgraded |", "|---|---|---|",
             *(f"| {name} | {a} | {c} |" for name, a, c in rows), "",
             "Upgrades: " + "; ".join(e.split(": ", 1)[1] for e in u["events"]) + ".", "",
             f"Then {m.get('rounds')} rounds with `min_protocol = 2`: the 0.1.0 agent answered {m.get('old_agent_answers')} "
             f"tasks, the operator was warned {m.get('operator_warnings')} time(s), the 0.1.0 agent "
             f"{'kept running' if m.get('old_agent_alive') else 'exited'}, the coordinator exited "
             f"{m.get('coordinator_exit')}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="tag", default="v0.1.0", help="the previous release's tag")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    from edgefl_protocol.version import release as this_release
    new = Release(this_release(), sys.executable, ROOT)
    with tempfile.TemporaryDirectory(prefix="edgefl-upgrade-") as tmp:
        work = Path(tmp)
        with previous_release(args.tag, work) as old:
            upgraded = drill(old, new, args.seed, work / "upgraded", upgrade=True)
            print(json.dumps({k: v for k, v in upgraded.items() if k != "events"}), flush=True)
            never = drill(old, new, args.seed, work / "never", upgrade=False)
    result = {"measured_with": provenance.measured_with(provenance.invoked(), {
                  "devices": len(DEVICES), "rounds": ROUNDS, "model": MODEL, "dataset": DATASET,
                  "rounds_settings": ROUND_SETTINGS,
                  "stays_old": STAYS_OLD, "seed": args.seed}),
              "from_version": old.name, "to_version": new.name,
              "rounds_completed": upgraded["rounds_completed"], "rounds_skipped": upgraded["rounds_skipped"],
              "rounds_repeated": upgraded["rounds_repeated"],
              "updates_lost_with_reason": upgraded["updates_lost_with_reason"],
              "updates_lost_without_reason": upgraded["updates_lost_without_reason"],
              "final_accuracy": upgraded["final_accuracy"], "final_accuracy_never_upgraded": never["final_accuracy"],
              "upgraded": upgraded, "never_upgraded": never}
    provenance.write_result("upgrade", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
