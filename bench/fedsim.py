"""A federation in one process, through the shipped engine: `bench.inmemory` (the agent's local
training, codec and error feedback, the coordinator's intake, trust bounds, default fold, server
rule and evaluation), with no broker in between. Used by `bench/algorithms.py`; `--check-mqtt`
there shows that it matches `broker-coordinator simulate` up to noise.

What `settings` does not set is the shipped default: the codec, the trust bounds and the fold
included, so a benchmark measures what ships unless it says otherwise in its `measured_with`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.aggregation.serving import ServedAverage
from edgefl_models.architectures import build_model, set_weights
from edgefl_models.datasets import Dataset
from edgefl_models.objectives import Objective

from .inmemory import InMemoryFederation, set_threads  # noqa: F401 (set_threads is used from here)


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
    # the last global model's accuracy and loss per round (what devices train from), whatever the
    # coordinator serves: the rows of bench/algorithms.py and bench/field_settings.py read it so
    accuracy: list[float]
    loss: list[float]
    local_seconds: list[float]                      # one per client-round
    signals: list[dict] = field(default_factory=list)  # per round: {device: metrics}
    # accuracy of an exponential moving average of the global models, per decay: what serving an
    # average instead of the last model would give any algorithm (measured beside, never fed back)
    ema_accuracy: dict[str, list[float]] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)  # per round: participants, clipped, rejected
    # what the coordinator evaluated: its served average (`serve_average`, 0.75 by default), or the
    # last model when serve_average = 0
    served_accuracy: list[float] = field(default_factory=list)


EMA_DECAYS = (0.5, 0.75, 0.9)


def run(fed: Federation, settings: RoundSettings, seed: int, mirror_agent_seed: bool = False,
        keep_signals: bool = False, progress=None, fleet: list[str] | None = None) -> RunResult:
    settings.validate()
    sim = InMemoryFederation(fed.arch, fed.clients, fed.test, settings, seed, fed.clients_per_round,
                             fleet=fleet or [], mirror_agent_seed=mirror_agent_seed)
    coordinator = sim.coordinator
    result = RunResult([], [], [])
    averages = {decay: ServedAverage(coordinator.weights, decay) for decay in EMA_DECAYS}
    served = build_model(fed.arch)
    objective = Objective()
    for round_no in range(1, fed.rounds + 1):
        record = sim.round(round_no)
        if record is None:  # nothing accepted: the model stands
            accuracy, loss = (result.accuracy[-1], result.loss[-1]) if result.accuracy else (0.0, float("nan"))
            result.served_accuracy.append(result.served_accuracy[-1] if result.served_accuracy else 0.0)
        else:
            accuracy, loss = record.accuracy, record.loss
            result.served_accuracy.append(record.accuracy)
            if settings.serve_average:  # the coordinator scored its served average: score the last model too
                set_weights(served, coordinator.weights)
                last = objective.evaluate(served, fed.test)
                accuracy, loss = last.score, last.loss
            result.records.append({"round": round_no, "participants": record.participants,
                                   "clipped": dict(record.clipped), "rejected": dict(record.rejected)})
            for device, metrics in record.devices.items():
                if "train_seconds" in metrics:
                    result.local_seconds.append(float(metrics["train_seconds"]))
            if keep_signals:
                result.signals.append({d: dict(m) for d, m in record.devices.items()})
        result.accuracy.append(accuracy)
        result.loss.append(loss)
        for decay, average in averages.items():
            weights = average.update(coordinator.weights)
            if record is not None and decay == settings.serve_average:  # the coordinator scored this average
                score = record.accuracy
            else:
                set_weights(served, weights)
                score = objective.evaluate(served, fed.test).score
            result.ema_accuracy.setdefault(str(decay), []).append(score)
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
