"""Probes behind two serving defaults, on the headline partition (bench/serving_local.py's federation):

- `codec`: which codec a serving release's delta goes down in. The releases of one run are replayed
  through `delta_downlink.Broadcast(skips=True)` in each codec; per codec, the median delta's bytes and
  how far the release devices would hold scores below the served average it encodes (central test
  accuracy, every release).
- `prior`: how strongly personalized serving adds a device's label frequencies. The last release of
  each seed's run, per device: the release, fixed strengths, and the strength fitted on the device's
  training data (what `edge_agent.personalize` ships), scored on its held-out data.

What they measured is in docs/RESEARCH.md, "Probes".

    python -m research.probe_serving codec 1
    python -m research.probe_serving prior 1,2,3
"""

from __future__ import annotations

import sys

import numpy as np

from bench import inmemory, serving_local
from bench.algorithms import ROUND_TIMEOUT, fleet_for
from bench.settings import headline
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.settings.serving_settings import ServingSettings
from edge_agent import personalize
from edge_agent.sources.base import held_out_mask, split
from edgefl_protocol import delta_downlink
from edgefl_models.architectures import build_model, set_weights
from edgefl_models.objectives import Objective

CODECS = ("q8c64+zlib", "q4c64+zlib", "topk0.5+q4c64+zlib", "topk0.25+q4c64+zlib", "topk0.1+q4c64+zlib")
STRENGTHS = (1.0, 2.0, 3.0)


def releases(seed: int) -> tuple[list, list]:
    """Every serving release of one 40-round run ((version, weights), as devices fetch them in full, the
    served average: `[serving] downlink = "full"`), and each device's training and held-out data."""
    fed = headline()
    local = [split(c, held_out_mask("npz", 0, len(c), serving_local.HOLDOUT)) for c in fed.clients]
    sim = inmemory.InMemoryFederation(fed.arch, [d.train for d in local], fed.test,
                                      RoundSettings(clients_per_round=fed.clients_per_round,
                                                    round_timeout=ROUND_TIMEOUT),
                                      seed, fed.clients_per_round, fleet=fleet_for(len(fed.clients), seed),
                                      serving=ServingSettings(downlink="full"))
    out = []
    for round_no in range(1, fed.rounds + 1):
        sim.round(round_no)
        fetched = serving_local.fetch_release(sim)
        if fetched and (not out or fetched[0].version != out[-1][0]):
            out.append((fetched[0].version, fetched[1]))
    return out, local


def codec(seed: int) -> None:
    fed, objective = headline(), Objective()
    model = build_model(fed.arch)

    def score(weights: dict) -> float:
        set_weights(model, weights)
        return objective.evaluate(model, fed.test).score

    served, _ = releases(seed)
    full = len(delta_downlink.body_of(served[-1][1]))
    for name in CODECS:
        stream, sizes, gaps = None, [], []
        for version, weights in served:
            if stream is None:
                stream = delta_downlink.Broadcast(weights, version, name, 4, skips=True)
                continue
            held = stream.advance(weights, version)
            sizes.append(len(stream.deltas[version]))
            gaps.append(100 * (score(weights) - score(held)))
        print(f"{name}: median delta {int(np.median(sizes)):,} B ({full / np.median(sizes):.1f}x smaller than "
              f"{full:,}); served average minus release: worst {max(gaps):+.2f}, mean {np.mean(gaps):+.3f} points "
              f"over {len(gaps)} releases", flush=True)


def prior(seed: int) -> None:
    fed, objective = headline(), Objective()
    served, local = releases(seed)
    model = build_model(fed.arch)
    set_weights(model, served[-1][1])
    model.eval()
    rows: dict[str, list[float]] = {}
    strengths = []
    for device in local:
        rows.setdefault("release", []).append(objective.evaluate(model, device.held_out).score)
        fitted = personalize.with_label_prior(model, device.train, objective)
        rows.setdefault("fitted", []).append(objective.evaluate(fitted.model, device.held_out).score)
        strengths.append(fitted.detail["strength"])
        for strength in STRENGTHS:
            fixed = personalize.with_label_prior(model, device.train, objective, strength).model
            rows.setdefault(f"strength {strength:g}", []).append(objective.evaluate(fixed, device.held_out).score)
    print(f"seed {seed}, release {served[-1][0]}, held-out accuracy (%): " + ", ".join(
        f"{name} {100 * np.mean(values):.2f}" for name, values in rows.items())
          + f"; fitted strengths: median {np.median(strengths):g}", flush=True)


if __name__ == "__main__":
    what, seeds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    inmemory.set_threads(1)
    for s in seeds:
        {"codec": codec, "prior": prior}[what](s)
