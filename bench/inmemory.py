"""The shipped engine with an in-memory transport: benchmarks that need many runs without a broker.

Each round, the driver selects the cohort as the coordinator does, and every selected device runs the
agent's own step, `edge_agent.device_step.device_step`: it chooses its local epochs from its speed and
the deadline when the task says `local_epochs = 0`, trains with the algorithm's client rule, encodes
the delta with the task's codec and its own error feedback, and signs the update with its key. The
signed payloads go through the engine's in-memory transport (`simulation.in_memory.fold_round`): signature, validation, trust bounds, the
default fold, the server rule, evaluation. A device commits its algorithm state and its codec residual
only for what the fold folded, as it folded it (the verdict its receipt would carry), as the agent
does (`edge_agent.settlement`).

What differs from a run over MQTT, each a parameter of the step: no broker, no deadline clock (a
device's epochs are planned against `round_timeout` at its emulated speed), a device's speed is the
host's throughput per CPU-second (pinned in bench/host_speed.json: bench/host_speed.py) times its
class's speed (`broker_coordinator.simulation.fleet.PROFILES`), the local shuffling is seeded by
(device, round, run) unless `mirror_agent_seed`, and the codec's stochastic rounding is seeded by the
same instead of drawn from the OS. So two runs of the same federation give the same model.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench import host_speed as host_speeds
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.rounds import RoundFailed
from broker_coordinator.settings.round_settings import RoundRecord
from broker_coordinator.engine.selection import select
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.settings.serving_settings import ServingSettings
from broker_coordinator.simulation.fleet import PROFILES
from broker_coordinator.simulation.in_memory import fold_round
from edge_agent.device_step import Budget, Step, device_step
from edge_agent.settlement import apply_verdict
from edgefl_protocol import messages, signing
from edgefl_models.architectures import build_model, set_weights
from edgefl_models.datasets import Dataset

FED = "bench"
MAX_VALUES = 1 << 26
_host_speed: dict[str, float] = {}


def host_speed(arch: str) -> float:
    """Training samples per CPU-second of one thread for `arch`: pinned in bench/host_speed.json
    (bench/host_speed.py says why), else calibrated once per process by CPU time, not wall time (by
    wall time a worker beside other jobs measured the MNIST MLP at 1,083 samples/s instead of 3,067)."""
    if arch not in _host_speed:
        speed = host_speeds.pinned().get(arch)
        if speed is None:
            logging.getLogger(__name__).warning("no pinned host speed for %s: calibrating in this process, so its "
                                                "devices' epochs may differ from another run's "
                                                "(python -m bench.host_speed --pin)", arch)
            speed = host_speeds.calibrate(arch)
        _host_speed[arch] = speed
    return _host_speed[arch]


def pin_host_speed(arch: str, samples_per_cpu_s: float) -> None:
    """Emulate this process's devices at a given host speed (a run paired with a cached run made before
    the speed was pinned: same speed, same epochs, so only what the pair varies differs)."""
    _host_speed[arch] = samples_per_cpu_s


# (device, delta, num_samples, round) -> (delta, num_samples): what a malicious device sends instead
Tamper = Callable[[str, dict[str, np.ndarray], int, int], tuple[dict[str, np.ndarray], int]]


@dataclass
class InMemoryFederation:
    arch: str
    clients: list[Dataset]
    test: Dataset
    settings: RoundSettings
    seed: int = 0
    clients_per_round: int = 10
    fleet: list[str] = field(default_factory=list)  # a device class per client (default: all pi4)
    data_of: Callable[[str, Dataset], Dataset] | None = None  # a device's training data (attacks change it)
    tamper: Tamper | None = None
    mirror_agent_seed: bool = False  # the agent's local shuffling seed (device/round), not device/round/seed
    serving: ServingSettings | None = None  # [serving]: releases retained in the in-memory transport
    root: Dataset | None = None  # [federation] root_data: the coordinator's small trusted set

    def __post_init__(self) -> None:
        self.devices = [f"dev-{i:03d}" for i in range(len(self.clients))]
        self.data = dict(zip(self.devices, self.clients))
        self.keys = {d: signing.new_key() for d in self.devices}
        self.classes = dict(zip(self.devices, self.fleet or ["pi4"] * len(self.devices)))
        self.states: dict[str, dict] = {d: {} for d in self.devices}
        self.coordinator = Engine(FED, self.arch, self.test, self.settings, seed=self.seed,
                                  device_keys=self.keys, serving=self.serving, root_set=self.root)
        self.rng = random.Random(self.seed)
        self.last_metrics: dict[str, dict] = {}

    def round(self, round_no: int) -> RoundRecord | None:
        """One round through the coordinator's own intake and fold; None if nothing was accepted."""
        k = len(self.devices) if self.clients_per_round == 0 else min(self.clients_per_round, len(self.devices))
        private = self.coordinator.privacy  # [privacy]: its own sampling and budget stop, as over MQTT
        if private:
            private.check_budget(round_no)
        cohort = sorted(private.cohort(self.devices) if private else
                        select(self.settings.selection, self.devices, k, self.rng, self.last_metrics))
        hp = self.settings.task_hparams(round_no)
        trained = {device: self.train(device, round_no, hp) for device in cohort}
        try:
            record = fold_round(self.coordinator, {d: t.payload for d, t in trained.items()}, round_no)
        except RoundFailed:
            record = None
        for device, step in trained.items():
            self.settle(device, round_no, step)
            self.last_metrics[device] = step.result.metrics
        return record

    def task(self, round_no: int, hp: dict) -> messages.Task:
        """The round's task as the coordinator words it (no deadline: epochs are planned against
        `round_timeout`, see `train`)."""
        c = self.coordinator
        return messages.Task(round_no, c.version, 0.0, self.settings.algorithm, hp, c.server_rule.broadcast(),
                             c.settings.codec, 1, c.objective.task, c.objective.loss)

    def train(self, device: str, round_no: int, hp: dict) -> Step:
        """`device`'s step for the round: the agent's own, on the model the coordinator holds."""
        model = build_model(self.arch)
        set_weights(model, self.coordinator.weights)
        data = self.data_of(device, self.data[device]) if self.data_of else self.data[device]
        local_seed = f"{device}/{round_no}" if self.mirror_agent_seed else f"{device}/{round_no}/{self.seed}"
        # the quantizer's stochastic rounding from a seed of (device, round, run), where the agent draws it
        # from the OS: the same distribution, and a rerun of a run gives the same model
        rounding = np.random.default_rng(zlib.crc32(f"codec/{local_seed}".encode()))
        tamper = self.tamper
        return device_step(
            self.task(round_no, hp), model, data, self.states[device], device=device, federation=FED,
            key=self.keys[device], seed=zlib.crc32(local_seed.encode()),
            budget=Budget(lambda: host_speed(self.arch) * PROFILES[self.classes[device]].speed,
                          self.settings.round_timeout, clock=lambda: 0.0),  # emulated: the speed takes no time
            released=self.coordinator.server_rule.broadcast_tensors(), rounding=rounding,
            tamper=None if tamper is None else lambda delta, n: tamper(device, delta, n, round_no))

    def settle(self, device: str, round_no: int, step: Step, judge: Any = None) -> None:
        """The agent's answer to its receipt: commit what the fold folded, at its scale; owe all of it
        when the coordinator rejected it (`edge_agent.settlement`). `judge`: whoever received the
        update (its `verdicts` and `accepted`): the coordinator, or in sites the device's site worker."""
        judge = self.coordinator if judge is None else judge
        verdict = judge.verdicts.of((device, round_no, 1))
        if (device, round_no, 1) not in judge.intake.accepted:
            kind, scale = "rejected", 0.0
        elif verdict is None or verdict.kind not in ("folded", "clipped", "left_out"):
            kind, scale = "unknown", 0.0  # never: fold_round closes the round, so every verdict is final
        else:
            kind, scale = verdict.kind, verdict.scale
        apply_verdict(self.states[device], step.sent, kind, scale)


def set_threads(n: int = 1) -> None:
    torch.set_num_threads(n)
