"""A federation in one process: the agent's `train_locally`, the algorithms'
ClientRule / ServerRule classes and the coordinator's `StreamingMean`, with
no broker in between. Used by `bench/algorithms.py`; `--check-mqtt` there shows
that it matches `broker-coordinator simulate` up to noise.

What is identical to a run over MQTT: model initialisation (build_model(arch,
seed)), the task hyper-parameters (RoundSettings.task_hparams, lr decay
included), cohort selection (selection.select with random.Random(seed) over sorted
device names), per-device state dicts, the order of updates, the
server rule. What differs: no codec (float32 either way), no deadline, and
the local shuffling seed (`mirror_agent_seed` reproduces the agent's).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from broker_coordinator.aggregation import StreamingMean
from broker_coordinator.coordinator import RoundSettings
from broker_coordinator.evaluation import evaluate
from broker_coordinator.selection import select
from broker_coordinator.serving import ServedAverage
from edge_agent.agent import local_settings
from edge_agent.training import train_locally
from edgefl_protocol import algorithms
from edgefl_protocol.algorithms.base import EXTRA_PREFIX
from models.architectures import build_model, get_weights, set_weights
from models.datasets import Dataset


@dataclass
class Federation:
    name: str
    arch: str
    clients: list[Dataset]
    test: Dataset
    rounds: int = 40
    clients_per_round: int = 10


@dataclass
class RunResult:
    accuracy: list[float]
    loss: list[float]
    local_seconds: list[float]                      # one per client-round
    signals: list[dict] = field(default_factory=list)  # per round: {device: metrics}
    # accuracy of an exponential moving average of the global models, per decay: what serving an
    # average instead of the last model would give any algorithm (measured beside, never fed back)
    ema_accuracy: dict[str, list[float]] = field(default_factory=dict)


EMA_DECAYS = (0.5, 0.75, 0.9)


def run(fed: Federation, settings: RoundSettings, seed: int, mirror_agent_seed: bool = False,
        keep_signals: bool = False, progress=None) -> RunResult:
    settings.validate()
    algorithm = algorithms.get(settings.algorithm)
    model = build_model(fed.arch, seed)
    weights = get_weights(model)
    specs = {name: a.shape for name, a in weights.items()}
    server = algorithm.server(settings.task_hparams(1))
    extra_specs = server.extra_specs(specs)
    devices = [f"dev-{i:03d}" for i in range(len(fed.clients))]
    data = dict(zip(devices, fed.clients))
    states: dict[str, dict] = {d: {} for d in devices}
    rng = random.Random(seed)
    last_metrics: dict[str, dict] = {}
    result = RunResult([], [], [])
    averages = {decay: ServedAverage(weights, decay) for decay in EMA_DECAYS}
    served_average = ServedAverage(weights, settings.serve_average)  # what `accuracy` evaluates, as the coordinator
    served = build_model(fed.arch)
    for round_no in range(1, fed.rounds + 1):
        server.start_round(round_no, len(devices))
        k = len(devices) if settings.clients_per_round == 0 else min(settings.clients_per_round, len(devices))
        cohort = sorted(select(settings.selection, devices, k, rng, last_metrics))
        hp = settings.task_hparams(round_no)
        broadcast, tensors = server.broadcast(), server.broadcast_tensors()
        deltas = StreamingMean(specs, normalize_steps=settings.normalize_steps)
        extras = StreamingMean(extra_specs) if extra_specs else None
        reported = {}
        for device in cohort:
            local = build_model(fed.arch)
            set_weights(local, weights)
            rule = algorithm.client(hp, broadcast, states[device], tensors)
            local_seed = (zlib.crc32(f"{device}/{round_no}".encode()) if mirror_agent_seed
                          else zlib.crc32(f"{device}/{round_no}/{seed}".encode()))
            out = train_locally(local, data[device], rule, local_settings(hp), local_seed)
            delta = {n: a for n, a in out.delta.items() if not n.startswith(EXTRA_PREFIX)}
            deltas.add(delta, server.weight(out.num_samples, out.metrics), int(out.metrics["steps"]))
            if extras is not None:
                extras.add({n: out.delta[n] for n in extra_specs}, 1.0)
            server.observe(device, out.num_samples, out.metrics)
            result.local_seconds.append(float(out.metrics["train_seconds"]))
            reported[device] = {"num_samples": out.num_samples, **out.metrics}
            last_metrics[device] = dict(out.metrics)
        weights = server.new_global(weights, deltas.mean(), extras.mean() if extras is not None else None)
        set_weights(model, served_average.update(weights))
        accuracy, loss = evaluate(model, fed.test)
        result.accuracy.append(accuracy)
        result.loss.append(loss)
        for decay, average in averages.items():
            set_weights(served, average.update(weights))
            result.ema_accuracy.setdefault(str(decay), []).append(evaluate(served, fed.test)[0])
        if keep_signals:
            result.signals.append(reported)
        if progress:
            progress(round_no, accuracy)
    return result


def split_validation(clients: list[Dataset], fraction: float = 0.2, seed: int = 0) -> tuple[list[Dataset], Dataset]:
    """Carve `fraction` of every client's training data (at least one sample) into a pooled validation set."""
    rng = np.random.default_rng(seed)
    kept, held = [], []
    for client in clients:
        perm = rng.permutation(len(client))
        cut = max(1, int(round(fraction * len(client))))
        held.append(client.subset(perm[:cut]))
        kept.append(client.subset(perm[cut:]))
    val = Dataset(np.concatenate([h.x for h in held]), np.concatenate([h.y for h in held]))
    return kept, val


def set_threads(n: int = 1) -> None:
    torch.set_num_threads(n)
