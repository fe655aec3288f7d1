"""`make serving`, on the devices' own data: what each device serves, through the agent's own gate.

The headline partition (MNIST-5k, 20 devices, Dirichlet 0.1; bench/settings.py) trains through the
shipped engine in memory (bench/inmemory.py) with the shipped defaults and `[serving]` on as `run`
has it. Each device holds out a fifth of its samples as the agent does (`[data] holdout = 0.2`, the
same hash of the row), trains on the rest, and after every round fetches the coordinator's serving
release from the transport's retained messages (manifest, chunks, sha256), as an agent fetches it from
the broker (with the default `[serving] downlink = "delta"`, the full model retained is the release
as the deltas reconstruct it; `release_gap` compares it with the served average it encodes, on the
test set). It offers the release to its own serving store through the agent's gate
(`edge_agent.serving_gate.ServingGate`, personalized serving on) and records the decision.

At the end, on each device's held-out data: the global served model (the last release), its
personalized copy (`edge_agent.personalize`, `personalize = "prior"`; "tune" beside it, evaluated
only at the end), and what the gate serves (the store's current version, read back from disk);
their means over the devices are `local_accuracy`. The gate chose what it serves by those same
held-out samples, so `local_test_accuracy` scores the three again on data no device holds: the
global test set weighted by each device's label frequencies (its own distribution). `served_worse_than_margin` counts the offers after which the store's current
version, read back from disk, scored worse on the device's held-out data than the one it had before
by more than the gate's margin: the gate's promise, checked from the outside.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import inmemory
from bench.algorithms import ROUND_TIMEOUT, fleet_for
from bench.settings import headline
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.settings.serving_settings import ServingSettings as CoordinatorServing
from edge_agent.config import ServingSettings
from edge_agent.personalize import personalize
from edge_agent.serving import load_model, read_current
from edge_agent.serving_gate import ServingGate
from edge_agent.sources.base import held_out_mask, split
from edgefl_protocol import downlink, messages, topics
from edgefl_models.architectures import build_model, set_weights
from edgefl_models.objectives import Objective

HOLDOUT = 0.2  # the agent's [data] holdout default
PERSONALIZE = "prior"
TUNE_STEPS, TUNE_LR = 60, 0.01  # "tune", the agent's defaults
MAX_BYTES = 1 << 26


def fetch_release(sim: inmemory.InMemoryFederation) -> tuple[messages.ModelRelease, dict] | None:
    """What a device fetches: the retained manifest, its chunks, checked against the sha256."""
    retained = sim.coordinator.transport.retained
    payload = retained.get(topics.serving(inmemory.FED))
    if not payload:
        return None
    manifest = messages.decode_model(payload, MAX_BYTES)
    assembly = downlink.Assembly(manifest)
    for i in range(manifest.chunks):
        assembly.add(i, retained[topics.serving_chunk(inmemory.FED, manifest.version, i)])
    return manifest, downlink.decode_weights(manifest, assembly.body(), None, MAX_BYTES)


def run(seed: int, rounds: int | None = None, progress=print) -> dict:  # noqa: ANN001 - print-like
    fed = headline()
    rounds = rounds or fed.rounds
    local = [split(c, held_out_mask("npz", 0, len(c), HOLDOUT)) for c in fed.clients]
    settings = RoundSettings(clients_per_round=fed.clients_per_round, round_timeout=ROUND_TIMEOUT)
    sim = inmemory.InMemoryFederation(fed.arch, [d.train for d in local], fed.test, settings, seed,
                                      fed.clients_per_round, fleet=fleet_for(len(fed.clients), seed),
                                      serving=CoordinatorServing())
    objective = Objective()
    work = Path(tempfile.mkdtemp(prefix=f"edgefl-serving-local-{seed}-"))
    gate_settings = {d: ServingSettings(dir=str(work / d), personalize=PERSONALIZE) for d in sim.devices}
    gates = {d: ServingGate(gate_settings[d]) for d in sim.devices}
    data = dict(zip(sim.devices, local))
    decisions = {"published": 0, "published_personalized": 0, "kept": 0}
    worse, releases, started = 0, 0, time.time()
    release_gaps: list[float] = []  # central accuracy: the served average minus the release devices hold
    model = build_model(fed.arch)
    for round_no in range(1, rounds + 1):
        sim.round(round_no)
        fetched = fetch_release(sim)
        if fetched is None or not gates[sim.devices[0]].wants(fetched[0].version):
            continue
        releases += 1
        release, weights = fetched
        set_weights(model, weights)  # the release as the deltas reconstruct it, against what it encodes
        released_score = objective.evaluate(model, fed.test).score
        set_weights(model, sim.coordinator.served.weights)
        release_gaps.append(objective.evaluate(model, fed.test).score - released_score)
        for device in sim.devices:
            before = stored_score(gates[device], data[device].held_out, objective)
            set_weights(model, weights)
            decision = gates[device].offer(release, round_no, model, data[device].held_out, objective,
                                           data[device].train)
            after = stored_score(gates[device], data[device].held_out, objective)
            if before is not None and after is not None and before - after > gate_settings[device].gate_margin:
                worse += 1
            key = "kept" if not decision.published else \
                "published_personalized" if decision.released_score is not None else "published"
            decisions[key] += 1
        progress(f"seed {seed} round {round_no}: release {release.version}, {decisions}")
    release, weights = fetch_release(sim)
    set_weights(model, weights)
    held: dict[str, list[float]] = {k: [] for k in ("global", "personalized", "tuned", "served")}
    test: dict[str, list[float]] = {k: [] for k in held}
    strengths = []  # the label prior's strength each device fitted on its training data
    for device in sim.devices:
        held_out, train = data[device].held_out, data[device].train
        _, meta, body = read_current(gates[device].store.root)
        own = personalize(model, train, objective, PERSONALIZE, 0, 0.0)
        strengths.append(own.detail.get("strength"))
        candidates = {"global": model, "served": load_model(meta, body), "personalized": own.model,
                      "tuned": personalize(model, train, objective, "tune", TUNE_STEPS, TUNE_LR,
                                           seed=release.version).model}
        for name, candidate in candidates.items():
            held[name].append(objective.evaluate(candidate, held_out).score)
            test[name].append(label_weighted(candidate, fed.test, train))
    mean = lambda values: round(sum(values) / len(values), 4)  # noqa: E731
    return {"seed": seed, "rounds": rounds, "releases": releases, "last_release": release.version,
            **{name: mean(values) for name, values in held.items()},
            "test": {name: mean(values) for name, values in test.items()},
            "per_device": {**held, "held_out": [len(data[d].held_out) for d in sim.devices], "strength": strengths},
            "decisions": decisions, "served_worse_than_margin": worse,
            "central_accuracy": round(objective.evaluate(model, fed.test).score, 4),
            "release_gap": {"max": round(max(release_gaps, key=abs), 4),
                            "mean": round(sum(release_gaps) / len(release_gaps), 4)},
            "seconds": round(time.time() - started, 1)}


def label_weighted(model, test, train) -> float:  # noqa: ANN001 - a module and two Datasets
    """Accuracy on the global test set weighted by the device's label frequencies: its own distribution,
    on samples no device holds."""
    import numpy as np
    import torch
    with torch.no_grad():
        predicted = model(torch.as_tensor(test.x)).argmax(dim=1).numpy()
    classes = int(max(test.y.max(), train.y.max())) + 1
    per_class = np.array([(predicted[test.y == c] == c).mean() if (test.y == c).any() else 0.0 for c in range(classes)])
    frequency = np.bincount(train.y, minlength=classes) / len(train.y)
    return float((per_class * frequency).sum())


def stored_score(gate: ServingGate, held_out, objective: Objective) -> float | None:  # noqa: ANN001 - a Dataset
    """The store's current version, read back from its files, on the device's held-out data."""
    if gate.store.current_version() is None:
        return None
    _, meta, body = read_current(gate.store.root)
    return objective.evaluate(load_model(meta, body), held_out).score
