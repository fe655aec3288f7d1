"""Sites: a tree of aggregators gives the flat federation's model; partials are validated like
updates; site brokers bridged to a central Mosquitto carry the model down and partials up; two
workers share a site's updates through `$share` and fold each exactly once."""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker_coordinator.coordinator import Coordinator, RoundSettings
from broker_coordinator.partials import SiteTask, decode_partial, encode_partial, encode_site_task
from broker_coordinator.site_aggregator import SiteWorker
from broker_coordinator.tree import SiteSpec, TreeCoordinator, quotas
from edgefl_protocol import codec, messages, signing
from edgefl_protocol.errors import Rejected
from models import datasets

FED = "test"
ARCH = "digits_mlp"


def signed_update(device: str, key: bytes, task: messages.Task, specs: dict, rng: np.random.Generator,
                  num_samples: int, metrics: dict | None = None) -> bytes:
    scale = rng.uniform(0.1, 2.0)
    tensors = {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in specs.items()}
    encoded = codec.encode(tensors, task.codec)
    update = messages.Update(device, task.round, task.model_version, num_samples,
                             {"steps": int(rng.integers(1, 9)), "sigma": float(rng.uniform()), "gamma": 0.5,
                              **(metrics or {})},
                             encoded.body, encoded.codec, encoded.specs, FED, task.attempt)
    return messages.encode_update(update, key)


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


def fleet(sites: dict[str, int]) -> dict[str, str]:
    """device -> site"""
    return {f"{site}-{i}": site for site, n in sites.items() for i in range(n)}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedsmoo", "dynsam"])
def test_tree_and_flat_fold_the_same_updates_into_the_same_model(digits, algorithm):
    settings = RoundSettings(algorithm=algorithm, codec="float32", aggregator="mean", norm_bound=0,
                             weighting="reported", normalize_steps=True, round_timeout=60)
    where = fleet({"north": 4, "south": 3, "east": 2})
    keys = {d: signing.new_key() for d in where}
    site_keys = {s: signing.new_key() for s in set(where.values())}
    flat = Coordinator(FED, ARCH, digits.test, settings, device_keys=keys)
    tree = TreeCoordinator(FED, ARCH, digits.test, settings, device_keys={},
                           sites={"north": SiteSpec(2, site_keys["north"]), "south": SiteSpec(1, site_keys["south"]),
                                  "east": SiteSpec(1, site_keys["east"])})
    specs = {**flat.specs, **flat.extra_specs}
    task = messages.Task(1, 0, time.time() + 60, algorithm, settings.task_hparams(1), {}, "float32", 1)
    rng = np.random.default_rng(3)
    payloads = {d: signed_update(d, keys[d], task, specs, rng, int(rng.integers(20, 200))) for d in where}

    flat_record = flat.fold_round(payloads)
    # north has two workers, each folding half of its devices (as $share would split them)
    workers = {("north", 0): ["north-0", "north-2"], ("north", 1): ["north-1", "north-3"],
               ("south", 0): ["south-0", "south-1", "south-2"], ("east", 0): ["east-0", "east-1"]}
    site_task = SiteTask(1, 1, 0, messages.encode("task", task),
                         {"weighting": "reported", "norm_bound": 0.0, "normalize_steps": True})
    partials = []
    for (site, index), devices in workers.items():
        worker = SiteWorker(FED, site, ARCH, site_keys[site], keys, worker=index)
        rnd = worker._open(site_task, task, {d for d, s in where.items() if s == site})
        for device in devices:
            worker._on_update(rnd, device, payloads[device], time.time())
        partials.append((site, encode_partial(worker.partial(rnd), site_keys[site])))
    tree_record = tree.fold_partials({"north": 4, "south": 3, "east": 2}, partials)

    assert tree_record.participants == flat_record.participants == len(where)
    for name in flat.weights:
        np.testing.assert_allclose(tree.weights[name], flat.weights[name], rtol=1e-5, atol=1e-6)
    assert tree.server_rule.broadcast() == pytest.approx(flat.server_rule.broadcast())
    assert any(not np.allclose(tree.weights[n], Coordinator(FED, ARCH, digits.test, settings).weights[n])
               for n in flat.weights), "the round changed nothing: the comparison would be empty"


def test_tree_mode_refuses_aggregators_a_partial_cannot_carry(digits):
    with pytest.raises(ValueError, match="aggregator = \"mean\""):
        TreeCoordinator(FED, ARCH, digits.test, RoundSettings(), sites={"north": SiteSpec(1, signing.new_key())})


def test_partials_are_validated_like_updates(digits):
    settings = RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean", round_timeout=60)
    key = signing.new_key()
    tree = TreeCoordinator(FED, ARCH, digits.test, settings, sites={"north": SiteSpec(1, key)})
    worker = SiteWorker(FED, "north", ARCH, key, {})
    task = messages.Task(1, 0, time.time() + 60, "fedavg", settings.task_hparams(1), {}, "float32", 1)
    rnd = worker._open(SiteTask(1, 1, 0, messages.encode("task", task), {}), task, {"north-0"})
    good = worker.partial(rnd)
    cap = 10 ** 7
    with pytest.raises(Rejected, match="signature"):
        decode_partial(encode_partial(good, signing.new_key()), key, "north", tree.specs, {}, cap)
    with pytest.raises(Rejected, match="sender"):
        decode_partial(encode_partial(good, key), key, "south", tree.specs, {}, cap)
    good.total_weight = float("nan")
    with pytest.raises(Rejected, match="not finite"):
        decode_partial(encode_partial(good, key), key, "north", tree.specs, {}, cap)
    with pytest.raises(Rejected, match="oversized"):
        decode_partial(b"x" * 100, key, "north", tree.specs, {}, 50)
    # a stale partial is logged and counted, never folded
    rnd_tree = tree._open_round(2, 1, {"north/0"}, time.time() + 60, 1)
    tree._on_partial(rnd_tree, "north", encode_partial(worker.partial(rnd), key))
    assert tree.rejections["stale"] == 1 and not rnd_tree.answered


def test_quotas_split_clients_over_sites_in_proportion():
    assert quotas(10, {"a": 30, "b": 10, "c": 0}) == {"a": 8, "b": 2}
    assert sum(quotas(1000, {"a": 2500, "b": 2500, "c": 2500, "d": 2499}).values()) == 1000
    assert quotas(0, {"a": 3, "b": 0}) == {"a": 0}
    assert quotas(50, {"a": 3, "b": 4}) == {"a": 3, "b": 4}
