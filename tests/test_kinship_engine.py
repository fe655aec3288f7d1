"""The opt-in kinship flag (aggregation/consensus.py) and verdict banks (aggregation/banks.py)
through the engine: the coordinator's rounds and a site's worker each flag the accomplices among
their own devices, say so in the round record and the partial, and carry the paths through a
checkpoint; a flagged update is held back in its own round at a site and in a buffered version. No broker: the signed payloads go
through the same intake and fold as over MQTT (simulation/in_memory.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker_coordinator.aggregation.consensus import KIN_MIN_ROUNDS
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.engine.site_aggregator import SiteWorker, site_rules
from broker_coordinator.simulation.in_memory import fold_round
from edgefl_protocol import codec, messages, signing
from edgefl_protocol.site_partials import SiteTask, encode_center
from edgefl_models import datasets

FED, ARCH = "test", "digits_mlp"
HONEST, ACCOMPLICES = [f"h{i}" for i in range(8)], ["k0", "k1"]
SETTINGS = RoundSettings(algorithm="fedavg", codec="float32", weighting="uniform", norm_bound=0, round_timeout=60,
                         kinship=0.4)


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


class Fleet:
    """Non-IID honest devices (the task, each one's own lasting direction, noise) and two accomplices
    that look as honest but all add one hidden goal: the round's median sees nothing wrong with them."""

    def __init__(self, specs: dict, seed: int = 3) -> None:
        self.specs, self.rng = specs, np.random.default_rng(seed)
        self.own = {d: self._draw() for d in HONEST}
        self.goal = self._draw()
        self.keys = {d: signing.new_key() for d in HONEST + ACCOMPLICES}

    def _draw(self) -> dict[str, np.ndarray]:
        return {n: self.rng.standard_normal(s).astype(np.float32) for n, s in self.specs.items()}

    def round(self, round_no: int, version: int = 0) -> dict[str, bytes]:
        task = self._draw()
        out = {}
        for device in HONEST + ACCOMPLICES:
            lasting = self.own.get(device, self.goal)
            noise = self._draw()
            tensors = {n: 0.01 * (task[n] + 1.5 * lasting[n] + 2 * noise[n]) for n in self.specs}
            encoded = codec.encode(tensors, "float32")
            update = messages.Update(device, round_no, version, 50, {"steps": 1}, encoded.body, encoded.codec,
                                     encoded.specs, FED, 1)
            out[device] = messages.encode_update(update, self.keys[device])
        return out


def test_the_coordinator_flags_accomplices_from_their_third_round_and_keeps_them_through_a_checkpoint(digits):
    coordinator = Engine(FED, ARCH, digits.test, SETTINGS, device_keys={})
    fleet = Fleet(coordinator.specs)
    coordinator.intake.keys = dict(fleet.keys)
    for round_no in range(1, KIN_MIN_ROUNDS + 2):
        record = fold_round(coordinator, fleet.round(round_no, coordinator.version), round_no)
        kin = {d for d, m in record.devices.items() if "kin" in m}
        assert kin == (set() if round_no < KIN_MIN_ROUNDS else set(ACCOMPLICES)), round_no
        assert record.clipped.get("kin", 0) == len(kin)
    assert coordinator.consensus.of("k0") < 1 and coordinator.consensus.of("h0") == 1.0
    restored = Engine(FED, ARCH, digits.test, SETTINGS, device_keys=dict(fleet.keys))
    restored.consensus.load_state(coordinator.consensus.state())
    assert set(restored.consensus.paths) == set(HONEST + ACCOMPLICES)


def test_a_site_flags_the_accomplices_among_its_own_devices(digits):
    fleet = Fleet(Engine(FED, ARCH, digits.test, SETTINGS).specs)
    site_key = signing.new_key()
    worker = SiteWorker(FED, "north", ARCH, site_key, dict(fleet.keys))
    center = {n: np.zeros(s, np.float32) for n, s in fleet.specs.items()}
    for round_no in range(1, KIN_MIN_ROUNDS + 1):
        task = messages.Task(round_no, 0, time.time() + 60, "fedavg", SETTINGS.task_hparams(round_no), {},
                             "float32", 1)
        site_task = SiteTask(round_no, 1, 0, messages.encode("task", task), site_rules(SETTINGS),
                             *encode_center(center))
        rnd = worker.open(site_task, task, set(fleet.keys))
        for device, payload in fleet.round(round_no).items():
            worker.intake.on_update(rnd, device, payload, time.time())
        partial = worker.partial(rnd)
        assert worker.consensus.kinship == SETTINGS.kinship
    assert partial.clipped.get("kin") == len(ACCOMPLICES)
    assert set(worker.consensus.kin) == set(ACCOMPLICES)


def _flipped_round(specs: dict, keys: dict, round_no: int, version: int, own_tasks: bool = False,
                   seed: int = 4) -> dict[str, bytes]:
    """Honest devices around one task, and k0 sending -3x it: the round's median flags k0. `own_tasks`:
    each device answers its own task (buffered: attempts 1, 2, ...)."""
    rng = np.random.default_rng(seed)
    task = {n: rng.standard_normal(s).astype(np.float32) for n, s in specs.items()}
    out = {}
    for attempt, device in enumerate(HONEST + ["k0"], start=1):
        tensors = ({n: -0.03 * task[n] for n in specs} if device == "k0" else
                   {n: 0.01 * (task[n] + 0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in specs.items()})
        encoded = codec.encode(tensors, "float32")
        update = messages.Update(device, round_no, version, 50, {"steps": 1}, encoded.body, encoded.codec,
                                 encoded.specs, FED, attempt if own_tasks else 1)
        out[device] = messages.encode_update(update, keys[device])
    return out


@pytest.mark.parametrize("where", ["site", "buffered"])
def test_verdict_banks_hold_back_a_flagged_update_in_its_own_round_at_a_site_and_buffered(digits, where):
    from broker_coordinator.engine.buffered import Ticket
    from broker_coordinator.engine.rounds import RoundState

    settings = RoundSettings(**{**SETTINGS.__dict__, "kinship": 0.0, "verdict_banks": 8})
    specs = Engine(FED, ARCH, digits.test, settings).specs
    keys = {d: signing.new_key() for d in HONEST + ["k0"]}
    if where == "site":
        worker = SiteWorker(FED, "north", ARCH, signing.new_key(), keys)
        task = messages.Task(1, 0, time.time() + 60, "fedavg", settings.task_hparams(1), {}, "float32", 1)
        center = {n: np.zeros(s, np.float32) for n, s in specs.items()}
        rnd = worker.open(SiteTask(1, 1, 0, messages.encode("task", task), site_rules(settings),
                                    *encode_center(center)), task, set(keys))
        for device, payload in _flipped_round(specs, keys, 1, 0).items():
            worker.intake.on_update(rnd, device, payload, time.time())
        clipped, held_back = worker.partial(rnd).clipped, rnd.aggregate.report().held_back
    else:
        buffered = RoundSettings(**{**settings.__dict__, "mode": "buffered", "buffer_size": len(keys),
                                    "max_staleness": 2})
        c = Engine(FED, ARCH, digits.test, buffered, device_keys=keys)
        c.center = {n: np.zeros(s, np.float32) for n, s in specs.items()}  # as at the site: a centre, no radius yet
        buffer = c.schedule.open_buffer(c, 1)
        for attempt, (device, payload) in enumerate(_flipped_round(specs, keys, 1, 0, own_tasks=True).items(), start=1):
            c.schedule.tickets[(1, attempt)] = Ticket(device, 0, time.time() + 60)
            c.schedule.working[device] = (1, attempt)
            buffer.cohort.add(device)
            c.intake.on_update(buffer, device, payload, time.time())
        c.set_state(buffer, RoundState.CLOSED)
        record = c.conclude(buffer, "")
        clipped, held_back = record.clipped, buffer.aggregate.report().held_back
    assert "k0" in held_back and clipped.get("held_back") == len(held_back) < len(keys)


def test_the_agreement_floor_and_flags_reach_the_coordinator_and_a_site_s_consensus(digits):
    settings = RoundSettings(**{**SETTINGS.__dict__, "kinship": 0.0, "agreement_floor": 0.05, "agreement_flags": 2})
    coordinator = Engine(FED, ARCH, digits.test, settings)
    assert coordinator.consensus.floor == 0.05 and coordinator.consensus.flags_to_act == 2
    fleet = Fleet(coordinator.specs)
    worker = SiteWorker(FED, "north", ARCH, signing.new_key(), dict(fleet.keys))
    task = messages.Task(1, 0, time.time() + 60, "fedavg", settings.task_hparams(1), {}, "float32", 1)
    center = {n: np.zeros(s, np.float32) for n, s in fleet.specs.items()}
    worker.open(SiteTask(1, 1, 0, messages.encode("task", task), site_rules(settings), *encode_center(center)),
                 task, set(fleet.keys))
    assert worker.consensus.floor == 0.05 and worker.consensus.flags_to_act == 2
