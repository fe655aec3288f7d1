"""The task index of a state directory (broker_coordinator/storage/tasks.py): a changed definition
archives the task and keeps the registry; a directory of release 0.1 becomes task 1 in place; a
switch that a crash interrupted is finished (or undone) by the next start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from broker_coordinator.access.registry import Registry
from broker_coordinator.storage.store import Checkpoint, Store, model_sha256
from broker_coordinator.storage.tasks import TaskDefinition, Tasks, read_tasks

LOGREG = TaskDefinition("logreg60", "f1", "classification", "cross_entropy", "fedavg", "ab" * 32)
MLP = TaskDefinition("synthetic_mlp", "f2", "classification", "cross_entropy", "fedavg", "ab" * 32)


def run_rounds(state: Path, arch: str, rounds: int, attempts: int = 1) -> None:
    """What a coordinator leaves: attempts, checkpoints (live and kept), round rows, the pacer's file."""
    store = Store(state)
    weights = {"w": np.full(3, float(rounds), np.float32)}
    for r in range(1, rounds + 1):
        for a in range(1, attempts + 1):
            store.start_attempt(r, a)
        record = dict(round=r, attempt=attempts, closed="complete", selected=3, participants=3, accuracy=0.5 + r / 100,
                      loss=1.0, bytes_up=10, seconds=0.1, rejected={}, model_sha256=model_sha256(weights),
                      score=0.5 + r / 100, metric="accuracy")
        store.save_checkpoint(Checkpoint(r, r, arch, weights, model_sha256(weights), {}, record))
        store.record_round(record)
    store.close()
    (state / "pacing.json").write_text(json.dumps({"state": "resting", "best": 0.9}))


def begin(state: Path, definition: TaskDefinition):  # noqa: ANN201 - Started
    tasks = Tasks(state)
    try:
        return tasks.begin(definition)
    finally:
        tasks.close()


@pytest.fixture
def state(tmp_path) -> Path:
    """A release 0.1 state directory: one enrolled device and two rounds of logreg60."""
    Registry(tmp_path / "coordinator.db").add("pi-01", "f", "$7$hash", "11" * 32, "token", 4e9)
    run_rounds(tmp_path, "logreg60", 2)
    return tmp_path


def test_a_fresh_directory_starts_task_1(tmp_path):
    started = begin(tmp_path, LOGREG)
    assert (started.task.id, started.fresh, started.task.first_version) == (1, True, 0)
    assert begin(tmp_path, LOGREG).task.id == 1 and not begin(tmp_path, LOGREG).fresh


def test_release_0_1_directory_is_task_1_in_place(state):
    assert [t.note for t in read_tasks(state)] == ["release 0.1 state directory: the next 'run' records it as task 1"]
    started = begin(state, LOGREG)
    assert started.migrated and started.previous is None and started.task.definition == LOGREG
    store = Store(state)
    assert [(r["round"], r["task"]) for r in store.rounds()] == [(1, 1), (2, 1)]
    assert store.load_checkpoint().round == 2 and store.task == 1  # nothing moved
    store.close()


def test_release_0_1_directory_of_another_model_is_archived_at_once(state):
    started = begin(state, MLP)
    assert started.migrated and started.previous.id == 1 and started.task.id == 2
    assert started.previous.definition.model == "logreg60"  # from its checkpoint
    assert Store(state / "tasks" / "1").load_checkpoint().arch == "logreg60"


def test_a_changed_definition_archives_the_task_and_keeps_the_devices(state):
    begin(state, LOGREG)
    started = begin(state, MLP)
    ended, task = started.previous, started.task
    assert (ended.id, ended.last_round, ended.last_version, ended.metric) == (1, 2, 2, "accuracy")
    assert ended.last_score == pytest.approx(0.52)
    assert (task.id, task.first_version) == (2, 3)  # past every version task 1 published
    assert MLP.changes(LOGREG) == "model logreg60 -> synthetic_mlp"

    archive = state / "tasks" / "1"
    assert sorted(p.name for p in archive.iterdir()) == ["checkpoint.msgpack", "checkpoints", "coordinator.db",
                                                         "pacing.json", "task.json"]
    old = Store(archive)
    assert [r["round"] for r in old.rounds()] == [1, 2] and old.kept_rounds() == [1, 2]
    old.close()
    assert json.loads((archive / "task.json").read_text())["definition"]["model"] == "logreg60"
    for name in ("checkpoint.msgpack", "checkpoints", "pacing.json"):  # the new task starts afresh
        assert not (state / name).exists()

    assert Registry(state / "coordinator.db").require("pi-01").signing_key == "11" * 32
    store = Store(state)
    assert store.rounds() == [] and store.load_checkpoint() is None and store.task == 2
    assert store.last_attempt(1) == 1 and store.last_attempt(3) == 0  # attempts go on past task 1's
    store.close()
    assert [(t.id, t.current) for t in read_tasks(state)] == [(1, False), (2, True)]


def test_attempt_floors_add_up_over_tasks_and_rounds_name_their_task(state):
    begin(state, LOGREG)
    begin(state, MLP)
    run_rounds(state, "synthetic_mlp", 1, attempts=3)  # task 2: round 1 took attempts 1-3 (the floor aside)
    begin(state, LOGREG)  # task 3, for the definition of task 1: a fresh start, not task 1 again
    store = Store(state)
    assert store.task == 3 and store.last_attempt(1) == 3 and store.last_attempt(2) == 1
    store.close()
    assert [r["task"] for r in Store(state / "tasks" / "2").rounds()] == [2]


@pytest.mark.parametrize("cleared", [False, True])
def test_a_switch_interrupted_before_its_commit_is_done_again(state, monkeypatch, cleared):
    begin(state, LOGREG)
    monkeypatch.setattr(Tasks, "_attempt_floor", lambda self: (_ for _ in ()).throw(OSError("power cut")))
    with pytest.raises(OSError):
        begin(state, MLP)  # tasks/1 is complete; task 1 is still current, its files still at the top
    monkeypatch.undo()
    assert (state / "tasks" / "1" / "coordinator.db").exists() and (state / "checkpoint.msgpack").exists()
    if cleared:  # what a backup holds that copied the database here and the files after the switch
        shutil.rmtree(state / "checkpoints")
        (state / "checkpoint.msgpack").unlink()
    started = begin(state, MLP)
    assert started.previous.id == 1 and started.previous.last_round == 2 and started.task.first_version == 3
    assert not (state / "checkpoint.msgpack").exists() and Store(state / "tasks" / "1").kept_rounds() == [1, 2]


def test_a_switch_interrupted_before_its_commit_is_dropped_when_the_config_goes_back(state, monkeypatch):
    begin(state, LOGREG)
    monkeypatch.setattr(Tasks, "_attempt_floor", lambda self: (_ for _ in ()).throw(OSError("power cut")))
    with pytest.raises(OSError):
        begin(state, MLP)
    monkeypatch.undo()
    (state / "pacing.json").unlink()  # as if a backup had been taken while the top was being cleared
    started = begin(state, LOGREG)
    assert started.task.id == 1 and started.previous is None and not (state / "tasks" / "1").exists()
    assert (state / "pacing.json").exists() and Store(state).load_checkpoint().round == 2


@pytest.mark.parametrize("removed", [(), ("checkpoints", "checkpoint.msgpack")])
def test_a_switch_interrupted_after_its_commit_is_finished(state, monkeypatch, removed):
    begin(state, LOGREG)
    monkeypatch.setattr(Tasks, "_remove_top_files", lambda self: (_ for _ in ()).throw(OSError("power cut")))
    with pytest.raises(OSError):
        begin(state, MLP)  # task 2 is current, task 1's files still at the top (or some of them)
    monkeypatch.undo()
    for name in removed:
        shutil.rmtree(state / name) if (state / name).is_dir() else (state / name).unlink()
    started = begin(state, MLP)
    assert started.task.id == 2 and started.previous is None
    assert not any((state / name).exists() for name in ("checkpoint.msgpack", "checkpoints", "pacing.json"))
    assert (state / "tasks" / "1" / "pacing.json").exists()
