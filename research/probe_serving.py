"""Probes behind two serving defaults, on the headline partition (bench/serving_local.py's federation):

- `codec`: which codec a serving release's delta goes down in. The releases of one run are replayed
  through `delta_downlink.Broadcast(skips=True)` in each codec; per codec, the median delta's bytes and
  how far the release devices would hold scores below the served average it encodes (central test
  accuracy, every release).
- `prior`: how strongly personalized serving adds a device's label frequencies. The last release of
  each seed's run, per device: the release, fixed strengths, and the strength fitted on the device's
  training data (what `edge_agent.personalize` ships), scored on its held-out data.
- `variants`: what else a device could make of the last release with its own training data, beside
  the shipped prior: the best single prior setting for the whole fleet chosen with hindsight on the
  held-out data (smoothing, temperature, strength: the prior family's ceiling), a bias per class or
  the whole last layer fitted on the training data (L2 towards the release, its weight by 5-fold
  cross-validation), the prior followed by the "tune" steps, and a kNN over the model's penultimate
  features mixed with the prior (kNN-Per, Marfoq et al., ICML 2022).

What they measured is in docs/RESEARCH.md, "Probes".

    python -m research.probe_serving codec 1
    python -m research.probe_serving prior 1,2,3
    python -m research.probe_serving variants 1,2,3
"""

from __future__ import annotations

import sys

import numpy as np
import torch

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


def last_release(seed: int) -> tuple[list, list, torch.nn.Module]:
    """A run's releases, the devices' data, and its last release as a model in eval mode."""
    served, local = releases(seed)
    model = build_model(headline().arch)
    set_weights(model, served[-1][1])
    return served, local, model.eval()


def prior(seed: int) -> None:
    objective = Objective()
    served, local, model = last_release(seed)
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


L2_WEIGHTS = (1e-3, 1e-2, 1e-1, 1.0)
HINDSIGHT = [(a, t, s) for a in (0.05, 0.5) for t in (0.5, 1.0, 2.0) for s in np.arange(0, 8.01, 0.5)]


def variants(seed: int) -> None:
    objective = Objective()
    served, local, model = last_release(seed)
    head = model.classifier[-1]
    release = (head.weight.detach().double(), head.bias.detach().double())
    rows: dict[str, list[float]] = {}
    hindsight: dict[tuple, list[float]] = {}
    for device in local:
        train, held = device.train, device.held_out
        y_train, y_held = (torch.as_tensor(np.asarray(d.y, dtype=np.int64)) for d in (train, held))
        features, held_features = _penultimate(model, train.x), _penultimate(model, held.x)
        own = personalize.with_label_prior(model, train, objective)
        own_bias = own.model.classifier[-1].bias.detach().double()
        accuracy = lambda logits: float((logits.argmax(1) == y_held).double().mean())  # noqa: E731
        rows.setdefault("release", []).append(accuracy(held_features @ release[0].T + release[1]))
        rows.setdefault("prior (shipped)", []).append(accuracy(held_features @ release[0].T + own_bias))
        counts = np.bincount(y_train.numpy(), minlength=release[1].numel()).astype(np.float64)
        logits = held_features @ release[0].T + release[1]
        for a, t, s in HINDSIGHT:
            log_prior = torch.as_tensor(np.log((counts + a) / (counts.sum() + a * len(counts)) * len(counts)))
            hindsight.setdefault((a, t, s), []).append(accuracy(logits / t + s * log_prior))
        bias_only = _fit_last_layer(features, y_train, release, bias_only=True)
        rows.setdefault("bias per class, fitted", []).append(accuracy(held_features @ bias_only[0].T + bias_only[1]))
        layer = _fit_last_layer(features, y_train, (release[0], own_bias), bias_only=False)
        rows.setdefault("prior, then last layer fitted", []).append(accuracy(held_features @ layer[0].T + layer[1]))
        tuned = personalize.tuned(own.model, train, objective, serving_local.TUNE_STEPS, serving_local.TUNE_LR,
                                  seed=served[-1][0])
        rows.setdefault("prior, then tuned", []).append(objective.evaluate(tuned, held).score)
        with torch.no_grad():
            prior_probs = torch.softmax(held_features @ release[0].T + own_bias, dim=1)
        nearest, at = (torch.nn.functional.normalize(held_features, dim=1)
                       @ torch.nn.functional.normalize(features, dim=1).T).topk(min(10, len(y_train)), dim=1)
        knn = torch.zeros_like(prior_probs).scatter_add_(1, y_train[at], torch.softmax(nearest / 0.1, dim=1))
        rows.setdefault("prior and kNN, half each", []).append(accuracy(0.5 * knn + 0.5 * prior_probs))
    best = max(hindsight, key=lambda k: np.mean(hindsight[k]))
    rows["best fleet-wide prior with hindsight (smoothing {:g}, temperature {:g}, strength {:g})".format(*best)] = \
        hindsight[best]
    print(f"seed {seed}, release {served[-1][0]}, held-out accuracy (%): " + "; ".join(
        f"{name} {100 * np.mean(values):.2f}" for name, values in rows.items()), flush=True)


def _penultimate(model: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model.classifier[:-1](model.features(torch.as_tensor(x))).double()


def _fit_last_layer(features: torch.Tensor, labels: torch.Tensor, start: tuple, bias_only: bool) -> tuple:
    """The last layer (or its bias alone) fitted on the training features, L2 towards `start`, its
    weight the one of L2_WEIGHTS with the least cross-entropy in 5-fold cross-validation."""
    folds = np.array_split(np.random.default_rng(0).permutation(len(labels)), 5)

    def fit(rows: np.ndarray, l2: float) -> tuple:
        weight = start[0].clone().requires_grad_(not bias_only)
        bias = start[1].clone().requires_grad_(True)
        optimizer = torch.optim.LBFGS([bias] if bias_only else [weight, bias], max_iter=100,
                                      line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(features[rows] @ weight.T + bias, labels[rows]) \
                + l2 / 2 * (((weight - start[0]) ** 2).sum() + ((bias - start[1]) ** 2).sum())
            loss.backward()
            return loss
        optimizer.step(closure)
        return weight.detach(), bias.detach()

    def held_loss(l2: float) -> float:
        total = 0.0
        for fold in folds:
            weight, bias = fit(np.setdiff1d(np.arange(len(labels)), fold), l2)
            total += float(torch.nn.functional.cross_entropy(features[fold] @ weight.T + bias, labels[fold],
                                                             reduction="sum"))
        return total
    return fit(np.arange(len(labels)), min(L2_WEIGHTS, key=held_loss))


if __name__ == "__main__":
    what, seeds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    inmemory.set_threads(1)
    for s in seeds:
        {"codec": codec, "prior": prior, "variants": variants}[what](s)
