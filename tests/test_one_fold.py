"""One fold under every schedule and topology: the same updates folded flat, in sites, buffered and
buffered in sites (a buffer of K = the cohort, every update trained on the current version) give
the same model to float tolerance, for every algorithm each schedule serves and for the default
fold with a centre and a radius that clips some of them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker_coordinator.engine.buffered import Ticket
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.engine.rounds import RoundState
from broker_coordinator.engine.site_aggregator import SiteWorker
from broker_coordinator.engine.tree import SiteSpec
from broker_coordinator.settings import composition
from broker_coordinator.simulation.in_memory import fold_partials, fold_round
from edgefl_protocol import codec, messages, signing
from edgefl_protocol.site_partials import SiteTask, encode_center, encode_partial
from edgefl_models import datasets

FED = "test"
ARCH = "digits_mlp"
SITES = {"north": 3, "south": 3}
# a radius history (1.5 x the median 2.4) that the spread of the updates below exceeds for some
RADIUS_HISTORY = {"by_device": {f"old-{i}": 2.0 + 0.1 * i for i in range(9)}}
# (algorithm, hparams): every one runs flat, in sites, buffered and in buffered sites
ALGORITHMS = [("fedavg", {}), ("fedsam", {}), ("feddyn", {}), ("fedsmoo", {}), ("dynsam", {}),
              ("dynsam", {"dual": 0, "global_perturbation": 0}), ("dynsam", {"dual_decay": 0.96})]


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


def _tensors(specs: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    scale = rng.uniform(0.1, 2.0)
    return {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in specs.items()}


def _signed(device: str, key: bytes, tensors: dict, attempt: int, metrics: dict) -> bytes:
    encoded = codec.encode(tensors, "float32")
    update = messages.Update(device, 1, 0, 50, metrics, encoded.body, encoded.codec, encoded.specs, FED, attempt)
    return messages.encode_update(update, key)


def _with_centre(coordinator: Engine, center: dict) -> Engine:
    coordinator.center = {n: a.copy() for n, a in center.items()}
    coordinator.radius.load_state(RADIUS_HISTORY)
    return coordinator


@pytest.mark.parametrize("algorithm,hparams", ALGORITHMS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()) or "defaults")
def test_the_same_updates_give_the_same_model_flat_in_sites_and_buffered(digits, algorithm, hparams):
    _same_everywhere(digits, algorithm, hparams)


@pytest.mark.parametrize("algorithm", ["fedavg", "dynsam"])
def test_sign_votes_hold_the_same_coordinates_flat_in_sites_and_buffered(digits, algorithm):
    """The sign-vote stage (aggregation/votes.py): a site's votes merge into the centre's."""
    _same_everywhere(digits, algorithm, {}, sign_quorum=0.4)


def _same_everywhere(digits, algorithm: str, hparams: dict, sign_quorum: float = 0.0) -> None:
    settings = RoundSettings(algorithm=algorithm, hparams=hparams, codec="float32", weighting="uniform",
                             norm_bound=0, round_timeout=60, sign_quorum=sign_quorum)
    assert settings.aggregator == "centered_clip"  # the default fold
    devices = [f"{site}-{i}" for site, n in SITES.items() for i in range(n)]
    keys = {d: signing.new_key() for d in devices}
    site_keys = {s: signing.new_key() for s in SITES}
    flat = Engine(FED, ARCH, digits.test, settings, device_keys=keys)
    rng = np.random.default_rng(5)
    center = {n: (0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in flat.specs.items()}
    _with_centre(flat, center)
    specs = {**flat.specs, **flat.extra_specs}
    tensors = {d: _tensors(specs, rng) for d in devices}
    metrics = {d: {"steps": int(rng.integers(1, 9)), "sigma": float(rng.uniform()), "gamma": 0.5} for d in devices}

    flat_record = fold_round(flat, {d: _signed(d, keys[d], tensors[d], 1, metrics[d]) for d in devices})
    if sign_quorum:
        assert 0.1 < flat_record.unvoted < 0.9, "the votes held no coordinate (or all): the comparison would be empty"
    assert flat_record.clipped.get("center", 0) >= 2, "no update was far enough to be clipped"
    assert any(not np.allclose(flat.weights[n], Engine(FED, ARCH, digits.test, settings).weights[n])
               for n in flat.weights), "the round changed nothing: the comparison would be empty"
    models = {"sites": _in_sites(digits, settings, keys, site_keys, center, tensors, metrics)}
    buffered = RoundSettings(**{**settings.__dict__, "mode": "buffered", "buffer_size": len(devices),
                                "max_staleness": 2})
    assert composition.refusals(buffered) == [] and composition.refusals(buffered, "sites") == []
    models["buffered"] = _buffered(digits, buffered, keys, center, tensors, metrics)
    models["buffered sites"] = _in_sites(digits, buffered, keys, site_keys, center, tensors, metrics)
    for where, coordinator in models.items():
        for name in flat.weights:
            np.testing.assert_allclose(coordinator.weights[name], flat.weights[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{where} differs from flat in {name}")
        assert coordinator.server_rule.broadcast() == pytest.approx(flat.server_rule.broadcast()), where


def _in_sites(digits, settings, keys, site_keys, center, tensors, metrics) -> Engine:
    """Each site's devices folded by its worker; the partials through the (sync or buffered) centre."""
    kind = Engine if settings.mode == "buffered" else Engine
    tree = _with_centre(kind(FED, ARCH, digits.test, settings, device_keys={},
                             sites={site: SiteSpec(1, site_keys[site]) for site in SITES}), center)
    partials = []
    for attempt, site in enumerate(SITES, start=1):  # buffered: each site its own task (a sync round: one)
        attempt = attempt if settings.mode == "buffered" else 1
        task = messages.Task(1, 0, time.time() + 60, settings.algorithm, settings.task_hparams(1), {}, "float32",
                             attempt)
        site_task = SiteTask(1, attempt, 0, messages.encode("task", task),
                             {"weighting": "uniform", "norm_bound": 0.0, "aggregator": settings.aggregator,
                              "sign_quorum": settings.sign_quorum},
                             *encode_center(center))
        mine = [d for d in tensors if d.startswith(site)]
        worker = SiteWorker(FED, site, ARCH, site_keys[site], keys)
        worker.open(site_task, task, set())  # learns the rules; then the same radius history as the centre
        worker.radius.load_state(RADIUS_HISTORY)
        rnd = worker.open(site_task, task, set(mine))
        for device in mine:
            worker.intake.on_update(rnd, device, _signed(device, keys[device], tensors[device], attempt,
                                                   metrics[device]), time.time())
        partials.append((site, encode_partial(worker.partial(rnd), site_keys[site])))
    if settings.mode != "buffered":
        fold_partials(tree, SITES, partials)
        return tree
    buffer = tree.schedule.open_buffer(tree, 1)
    for attempt, (site, payload) in enumerate(partials, start=1):
        tree.schedule.tickets[(1, attempt)] = Ticket(site, 0, time.time() + 60)
        tree.schedule.working[site] = (1, attempt)
        tree.topology.on_partial(tree, buffer, site, payload)
    assert buffer.aggregate.count == len(tensors) and not tree.intake.rejections and not tree.schedule.working
    tree.set_state(buffer, RoundState.CLOSED)
    tree.conclude(buffer, "")
    return tree


def _buffered(digits, buffered, keys, center, tensors, metrics) -> Engine:
    c = _with_centre(Engine(FED, ARCH, digits.test, buffered, device_keys=keys), center)
    buffer = c.schedule.open_buffer(c, 1)
    for attempt, device in enumerate(tensors, start=1):  # each device its own task, all from version 0
        c.schedule.tickets[(1, attempt)] = Ticket(device, 0, time.time() + 60)
        c.schedule.working[device] = (1, attempt)
        buffer.cohort.add(device)
        c.intake.on_update(buffer, device, _signed(device, keys[device], tensors[device], attempt, metrics[device]),
                     time.time())
    assert buffer.aggregate.count == len(tensors) and not c.intake.rejections
    c.set_state(buffer, RoundState.CLOSED)
    c.conclude(buffer, "")
    return c
