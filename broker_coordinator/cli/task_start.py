"""The task `broker-coordinator run` serves (broker_coordinator/storage/tasks.py): the config's task
definition, a new task when it changed (the old one archived, the devices kept), and numbers a
device cannot mistake: model versions past the previous task's (on the broker and in its cache),
and (round, attempt) pairs past those it ran (it skips a task that repeats one)."""

from __future__ import annotations

import logging
import time

from broker_coordinator.engine.flat import Devices
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.transport import MqttTransport
from broker_coordinator.settings.config import CoordinatorBroker, CoordinatorConfig
from broker_coordinator.storage.tasks import ARCHIVE, REMEMBERED_ROUNDS, Started, Task, TaskDefinition, Tasks
from edgefl_protocol import topics
from edgefl_protocol.persist import file_sha256

log = logging.getLogger("broker_coordinator")
# the previous task's newest versions whose retained releases a new task clears (a buffered schedule
# keeps the versions tasks still train from retained, the delta downlink a chain of them)
RETIRED_VERSIONS = 32


def task_definition(config: CoordinatorConfig) -> TaskDefinition:
    """What the config's task is (storage/tasks.py says why these keys and no others)."""
    from edgefl_models.architectures import build_model, fingerprint
    from edgefl_models.objectives import Objective
    fed = config.federation
    objective = Objective.of(fed.task, fed.loss)
    test_data = file_sha256(fed.test_data) if fed.test_data else ""
    return TaskDefinition(fed.model, fingerprint(build_model(fed.model)), objective.task, objective.loss,
                          config.rounds.algorithm, test_data)


def begin_task(config: CoordinatorConfig) -> Started:
    """The current task, or a new one when the config's definition changed; says so in one INFO
    line (and one more when a state directory of release 0.1 becomes task 1). Under the state lock."""
    definition = task_definition(config)
    tasks = Tasks(config.storage.state_dir)
    try:
        started = tasks.begin(definition)
    finally:
        tasks.close()
    task, previous = started.task, started.previous
    if started.migrated:
        first = previous or task
        log.info("state directory %s of release 0.1: its rounds and checkpoints are task 1 (%s), kept in place; "
                 "the device registry is unchanged", config.storage.state_dir, first.definition.describe())
    if previous is not None:
        score = (f", last {previous.metric} {previous.last_score:.4g}" if previous.last_score is not None else "")
        log.info("task %d starts at round 1 from a fresh model (%s): task %d (%d rounds%s) is archived in %s "
                 "and listed by 'broker-coordinator tasks'; %s", task.id, task.definition.changes(previous.definition),
                 previous.id, previous.last_round or 0, score, f"{config.storage.state_dir}/{ARCHIVE}/{previous.id}",
                 _devices(config))
    elif started.fresh:
        log.info("task %d: %s", task.id, task.definition.describe())
    return started


def connect_task(coordinator: Engine, started: Started, b: CoordinatorBroker) -> None:
    """Connect the engine for its task so that no version names two models to a device: a fresh
    task's versions start at the task's first version (past every earlier task's), and the previous
    task's retained releases are cleared (no device fetches the old model again)."""
    if coordinator.version < started.task.first_version:  # a fresh model: the engine counts from 0
        coordinator.version = started.task.first_version
    coordinator.connect(b.host, b.port, b.username, b.password, keepalive=b.keepalive)
    if started.previous is not None and isinstance(coordinator.transport, MqttTransport):
        _retire_releases(coordinator, started.previous)


def _retire_releases(coordinator: Engine, previous: Task) -> None:
    assert isinstance(coordinator.transport, MqttTransport)
    newest = max(previous.first_version, previous.last_version or 0)
    fed = coordinator.fed
    for version in range(max(previous.first_version, newest - RETIRED_VERSIONS + 1), newest):
        coordinator.transport.publish(topics.model(fed, version), b"", retain=True)
    if not coordinator.transport.publish_until(topics.model(fed, newest), b"", time.time() + 30, retain=True):
        log.info("the broker did not confirm clearing task %d's model version %d; devices that fetch it "
                 "again only spend the bytes", previous.id, newest)


def skip_attempts_the_devices_ran(coordinator: Engine) -> None:
    """A state restored from a backup older than the devices' last rounds: each device remembers the
    (round, attempt) pairs it ran and skips a task that repeats one, so the next rounds, which this
    state never started, begin at attempt 2 (the devices' statuses say how far they got). It reads
    the inbox: only once the engine checks what arrives (the registry's keys, admission)."""
    store = coordinator.store
    if store is None or not isinstance(coordinator.topology, Devices):
        return
    coordinator.settle_presence()  # their retained statuses, each with the last round the device ran
    reached = max((r for p in coordinator.presence.online.values()
                   if isinstance(r := p.get("last_round"), int) and not isinstance(r, bool)), default=0)
    first = max(coordinator.next_round, reached - REMEMBERED_ROUNDS + 1)
    unseen = {r: 1 for r in range(first, reached + 1) if store.last_attempt(r) == 0}
    if unseen:
        store.floor_attempts(unseen)
        log.info("the devices ran rounds up to %d, which this state directory never saw (restored from an "
                 "earlier backup?): rounds %d-%d start at attempt 2, past the devices' own", reached,
                 min(unseen), max(unseen))


def _devices(config: CoordinatorConfig) -> str:
    from broker_coordinator.access.registry import ACTIVE, Registry
    registry = Registry(config.registry_path)
    try:
        count = sum(1 for d in registry.devices(config.federation.name) if d.state == ACTIVE)
    finally:
        registry.close()
    return (f"the {count} enrolled device{'s' if count != 1 else ''} stay enrolled and train it" if count
            else "the device registry is unchanged")
