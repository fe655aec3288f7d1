"""Sites: a tree of aggregators gives the flat federation's model; partials are validated like
updates; site brokers bridged to a central Mosquitto carry the model down and partials up; two
workers share a site's updates through `$share` and fold each exactly once."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest

from broker_coordinator.access.broker import COORDINATOR_USER
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.engine.site_aggregator import SiteWorker, site_rules
from broker_coordinator.engine.tree import SiteSpec, quotas
from broker_coordinator.simulation.in_memory import fold_partials, fold_round
from broker_coordinator.simulation.local_sites import LocalSites
from broker_coordinator.storage.store import Store
from edgefl_protocol import codec, messages, signing, topics
from edgefl_protocol.errors import Rejected
from edgefl_protocol.site_partials import (
    SiteTask,
    decode_partial,
    encode_center,
    encode_partial,
    encode_site_task,
)
from edgefl_protocol.transport import connect, make_client
from edgefl_models import datasets

from .conftest import Recorder, flush

FED = "test"
ARCH = "digits_mlp"


def signed_update(device: str, key: bytes, task: messages.Task, specs: dict, rng: np.random.Generator,
                  num_samples: int, metrics: dict | None = None) -> bytes:
    scale = rng.uniform(0.1, 2.0)
    tensors = {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in specs.items()}
    encoded = codec.encode(tensors, task.codec)
    update = messages.Update(device, task.round, task.model_version, num_samples,
                             {"steps": int(rng.integers(1, 9)), "sigma": float(rng.uniform()), "gamma": 0.5,
                              "eval_metric": "accuracy", "eval_score": float(rng.uniform()),
                              "eval_loss": float(rng.uniform(0, 3)), "eval_count": int(rng.integers(5, 50)),
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
                             weighting="reported", normalize_steps=True, round_timeout=60, evaluate="both")
    where = fleet({"north": 4, "south": 3, "east": 2})
    keys = {d: signing.new_key() for d in where}
    site_keys = {s: signing.new_key() for s in set(where.values())}
    flat = Engine(FED, ARCH, digits.test, settings, device_keys=keys)
    tree = Engine(FED, ARCH, digits.test, settings, device_keys={},
                           sites={"north": SiteSpec(2, site_keys["north"]), "south": SiteSpec(1, site_keys["south"]),
                                  "east": SiteSpec(1, site_keys["east"])})
    specs = {**flat.specs, **flat.extra_specs}
    task = messages.Task(1, 0, time.time() + 60, algorithm, settings.task_hparams(1), {}, "float32", 1)
    rng = np.random.default_rng(3)
    payloads = {d: signed_update(d, keys[d], task, specs, rng, int(rng.integers(20, 200))) for d in where}

    flat_record = fold_round(flat, payloads)
    # north has two workers, each folding half of its devices (as $share would split them)
    workers = {("north", 0): ["north-0", "north-2"], ("north", 1): ["north-1", "north-3"],
               ("south", 0): ["south-0", "south-1", "south-2"], ("east", 0): ["east-0", "east-1"]}
    site_task = SiteTask(1, 1, 0, messages.encode("task", task),
                         {"weighting": "reported", "norm_bound": 0.0, "normalize_steps": True})
    partials = []
    for (site, index), devices in workers.items():
        worker = SiteWorker(FED, site, ARCH, site_keys[site], keys, worker=index)
        rnd = worker.open(site_task, task, {d for d, s in where.items() if s == site})
        for device in devices:
            worker.intake.on_update(rnd, device, payloads[device], time.time())
        partials.append((site, encode_partial(worker.partial(rnd), site_keys[site])))
    tree_record = fold_partials(tree, {"north": 4, "south": 3, "east": 2}, partials)
    observed = [row for _, p in partials for row in msgpack.unpackb(p[4 + signing.TAG_BYTES:])["observed"]]
    if algorithm == "fedavg":  # its server rule keeps no per-device state
        assert observed == []
    else:  # per device, only what the server rule reads (of steps, sigma, gamma)
        assert len(observed) == len(where) and all(set(row[2]) <= {"sigma", "gamma"} for row in observed)
        assert algorithm != "dynsam" or all(set(row[2]) == {"sigma", "gamma"} for row in observed)

    assert tree_record.participants == flat_record.participants == len(where)
    # the devices' evaluations of the model they received, pooled per site: the same federated score
    assert tree_record.federated["count"] == flat_record.federated["count"]
    assert tree_record.federated["devices"] == flat_record.federated["devices"] == len(where)
    assert tree_record.federated["score"] == pytest.approx(flat_record.federated["score"], rel=1e-12)
    assert tree_record.federated["loss"] == pytest.approx(flat_record.federated["loss"], rel=1e-12)
    for name in flat.weights:
        np.testing.assert_allclose(tree.weights[name], flat.weights[name], rtol=1e-5, atol=1e-6)
    assert tree.server_rule.broadcast() == pytest.approx(flat.server_rule.broadcast())
    assert any(not np.allclose(tree.weights[n], Engine(FED, ARCH, digits.test, settings).weights[n])
               for n in flat.weights), "the round changed nothing: the comparison would be empty"


@pytest.mark.parametrize("algorithm", ["fedavg", "feddyn", "dynsam"])
def test_the_default_fold_gives_the_same_model_flat_and_in_sites(digits, algorithm):
    """centered_clip with a centre (a round after the first) and a radius that clips some updates: each
    site judges its devices by the centre its task carries, as the flat coordinator judges them."""
    settings = RoundSettings(algorithm=algorithm, codec="float32", weighting="uniform", norm_bound=0,
                             round_timeout=60)
    assert settings.aggregator == "centered_clip"
    where = fleet({"north": 3, "south": 3})
    keys = {d: signing.new_key() for d in where}
    site_keys = {s: signing.new_key() for s in set(where.values())}
    flat = Engine(FED, ARCH, digits.test, settings, device_keys=keys)
    tree = Engine(FED, ARCH, digits.test, settings, device_keys={},
                           sites={site: SiteSpec(1, site_keys[site]) for site in site_keys})
    rng = np.random.default_rng(5)
    center = {n: (0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in flat.specs.items()}
    history = {"by_device": {f"old-{i}": 2.0 + 0.1 * i for i in range(9)}}  # radius 1.5 x 2.4
    for coordinator in (flat, tree):
        coordinator.center = {n: a.copy() for n, a in center.items()}
        coordinator.radius.load_state(history)
    specs = {**flat.specs, **flat.extra_specs}
    task = messages.Task(1, 0, time.time() + 60, algorithm, settings.task_hparams(1), {}, "float32", 1)
    payloads = {d: signed_update(d, keys[d], task, specs, rng, 50) for d in where}
    flat_record = fold_round(flat, payloads)
    assert flat_record.clipped.get("center", 0) >= 2, "no update was far enough to be clipped"

    site_task = SiteTask(1, 1, 0, messages.encode("task", task), {"weighting": "uniform", "norm_bound": 0.0,
                                                                  "aggregator": "centered_clip"},
                         *encode_center(center))
    partials = []
    for site in site_keys:
        worker = SiteWorker(FED, site, ARCH, site_keys[site], keys)
        worker.open(site_task, task, set())  # learns the rules; then the same radius history as the centre
        worker.radius.load_state(history)
        rnd = worker.open(site_task, task, {d for d, s in where.items() if s == site})
        for device in (d for d, s in where.items() if s == site):
            worker.intake.on_update(rnd, device, payloads[device], time.time())
        partials.append((site, encode_partial(worker.partial(rnd), site_keys[site])))
    tree_record = fold_partials(tree, {"north": 3, "south": 3}, partials)
    assert tree_record.clipped.get("center") == flat_record.clipped["center"]
    for name in flat.weights:
        np.testing.assert_allclose(tree.weights[name], flat.weights[name], rtol=1e-5, atol=1e-6)


def test_tree_mode_refuses_aggregators_a_partial_cannot_carry(digits):
    with pytest.raises(ValueError, match="aggregator = one of centered_clip, mean"):
        Engine(FED, ARCH, digits.test, RoundSettings(aggregator="gated_mean"),
                        sites={"north": SiteSpec(1, signing.new_key())})
    Engine(FED, ARCH, digits.test, RoundSettings(downlink="delta"),  # deltas cross the bridges
                    sites={"north": SiteSpec(1, signing.new_key())})


def test_partials_are_validated_like_updates(digits):
    settings = RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean", round_timeout=60)
    key = signing.new_key()
    tree = Engine(FED, ARCH, digits.test, settings, sites={"north": SiteSpec(1, key)})
    worker = SiteWorker(FED, "north", ARCH, key, {})
    task = messages.Task(1, 0, time.time() + 60, "fedavg", settings.task_hparams(1), {}, "float32", 1)
    rnd = worker.open(SiteTask(1, 1, 0, messages.encode("task", task), {}), task, {"north-0"})
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
    # junk from the site broker is logged, never served
    worker._handle("edgefl/test/site/north/task", b"\x00junk", time.time(), False)
    worker._handle("edgefl/test/site/north/cohort", b"\x92\x01", time.time(), False)
    assert worker.current is None and not worker.sent  # nothing opened, nothing sent
    # a partial from a site the config does not know is rejected with its reason
    tree.transport.inbox.put(("edgefl/test/site/west/partial", b"x", time.time(), False))
    tree.drain(0.1)
    assert tree.intake.rejections["unknown_site"] == 1
    # a stale partial is logged and counted, never folded
    rnd_tree = tree.open_round(2, 1, {"north/0"}, time.time() + 60, 1)
    tree.topology.on_partial(tree, rnd_tree, "north", encode_partial(worker.partial(rnd), key))
    assert tree.intake.rejections["stale"] == 1 and not rnd_tree.answered


def _tree_round(digits, forge: bool, seed: int = 7, store: Store | None = None):
    """One round of 4 sites of 3 devices (default fold and bounds, fedavg), the last site's aggregator
    compromised when `forge`: it sends a forged, correctly signed partial. Returns the aggregate step."""
    settings = RoundSettings(algorithm="fedavg", codec="float32", round_timeout=60)
    where = fleet({"north": 3, "south": 3, "east": 3, "west": 3})
    keys = {d: signing.new_key() for d in where}
    site_keys = {s: signing.new_key() for s in ("north", "south", "east", "west")}
    tree = Engine(FED, ARCH, digits.test, settings, device_keys={}, store=store,
                           sites={s: SiteSpec(1, k, devices=3) for s, k in site_keys.items()})
    rng = np.random.default_rng(seed)
    step = {n: (0.05 * rng.standard_normal(shape)).astype(np.float32) for n, shape in tree.specs.items()}
    tree.center = {n: a.copy() for n, a in step.items()}  # the last applied step
    before = {n: a.copy() for n, a in tree.weights.items()}
    task = messages.Task(1, 0, time.time() + 60, "fedavg", settings.task_hparams(1), {}, "float32", 1)
    site_task = SiteTask(1, 1, 3, messages.encode("task", task), site_rules(settings), *encode_center(step))
    partials = []
    for site in site_keys:
        worker = SiteWorker(FED, site, ARCH, site_keys[site], keys)
        rnd = worker.open(site_task, task, {d for d, s in where.items() if s == site})
        for device in sorted(d for d, s in where.items() if s == site):
            delta = {n: (a + 0.02 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in step.items()}
            encoded = codec.encode(delta, "float32")
            update = messages.Update(device, 1, 0, 100, {"steps": 5}, encoded.body, encoded.codec, encoded.specs,
                                     FED, 1)
            worker.intake.on_update(rnd, device, messages.encode_update(update, keys[device]), time.time())
        partial = worker.partial(rnd)
        assert partial.count == 3
        if forge and site == "west":  # its mean step -10x, its weight 100x, claiming 50 devices
            sums = codec.decode("float32", partial.specs, partial.body, None, 1 << 24)
            encoded = codec.encode({n: -1000.0 * a for n, a in sums.items()}, "float32")
            partial.specs, partial.body = encoded.specs, encoded.body
            partial.total_weight *= 100
            partial.weighted_steps *= 100
            partial.count = 50
        partials.append((site, encode_partial(partial, site_keys[site])))
    record = fold_partials(tree, {s: 3 for s in site_keys}, partials)
    assert not forge or 0 < tree.topology.site_standing["west"] < 1  # its next partials weigh less still
    return {n: tree.weights[n] - before[n] for n in before}, record


def test_a_compromised_site_moves_the_model_at_most_by_its_share(digits, caplog):
    """A site is one more device of the centre: a forged partial, correctly signed, is counted for at most
    the site's devices, weighed against the other sites' per-device weight, and its mean step clipped to
    the other sites' distance from the centre, so it moves the model no further than its share."""
    clean, _ = _tree_round(digits, forge=False)
    with caplog.at_level("WARNING", logger="broker_coordinator"):
        forged, record = _tree_round(digits, forge=True)
    honest_step = np.sqrt(sum(float(np.sum(np.square(a))) for a in clean.values()))
    moved = np.sqrt(sum(float(np.sum(np.square(forged[n] - clean[n]))) for n in clean))
    assert moved < 0.25 * honest_step, f"the forged partial moved the model {moved / honest_step:.2f}x an honest step"
    assert record.participants == 12  # the claimed 50 updates count as the site's 3
    assert record.clipped.get("site_count") == 1 and record.clipped.get("site_center") == 1
    assert "partial from site west" in caplog.text


def test_a_sites_lost_standing_survives_a_restart(digits, tmp_path):
    """The standing a forging site lost is in the checkpoint: a restarted centre does not trust it afresh."""
    _tree_round(digits, forge=True, store=Store(tmp_path / "state"))
    settings = RoundSettings(algorithm="fedavg", codec="float32", round_timeout=60)
    restarted = Engine(FED, ARCH, digits.test, settings, device_keys={}, store=Store(tmp_path / "state"),
                                sites={s: SiteSpec(1, signing.new_key(), devices=3)
                                       for s in ("north", "south", "east", "west")})
    assert set(restarted.topology.site_standing) == {"west"} and 0 < restarted.topology.site_standing["west"] < 1


class PublishedTo:
    """A site worker's session that records what it would publish (no broker)."""

    def __init__(self) -> None:
        self.retained: dict[str, bytes] = {}
        self.tasked: list[str] = []

    def publish_until(self, topic: str, payload: bytes, deadline: float, qos: int = 1, retain: bool = False) -> bool:
        self.retained[topic] = payload
        return True

    def publish_all(self, messages: list, deadline: float, qos: int = 1) -> list[str]:
        self.tasked += [topic.split("/")[3] for topic, _ in messages]
        return []


class ReceiptsToo(PublishedTo):
    """PublishedTo, keeping the receipts too: device -> [Receipt, ...]."""

    def __init__(self) -> None:
        super().__init__()
        self.receipts: dict[str, list[messages.Receipt]] = {}

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        if topic.endswith("/receipt"):
            self.receipts.setdefault(topic.split("/")[3], []).append(messages.decode_receipt(payload))


def test_a_site_tells_its_devices_left_out_when_the_centre_retries_the_round(digits):
    """A streaming fold tells a device "folded" on arrival; when the centre then tasks the same round
    again (its attempt made no version), the site tells that device its update was left out after all."""
    settings = RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean", round_timeout=60)
    keys = {"north-0": signing.new_key()}
    worker = SiteWorker(FED, "north", ARCH, signing.new_key(), keys)
    worker.transport = ReceiptsToo()  # type: ignore[assignment]

    def cohort(attempt: int) -> bytes:
        task = messages.Task(1, 0, time.time() + 60, "fedavg", settings.task_hparams(1), {}, "float32", attempt)
        site_task = SiteTask(1, attempt, 1, messages.encode("task", task), site_rules(settings))
        return msgpack.packb({"site_task": encode_site_task(site_task), "devices": ["north-0"]}, use_bin_type=True)

    worker._on_cohort(cohort(1))
    delta = {n: np.full(shape, 0.01, np.float32) for n, shape in worker.specs.items()}
    encoded = codec.encode(delta, "float32")
    update = messages.Update("north-0", 1, 0, 100, {"steps": 5}, encoded.body, encoded.codec, encoded.specs, FED, 1)
    worker.intake.on_update(worker.current, "north-0", messages.encode_update(update, keys["north-0"]), time.time())
    worker._on_cohort(cohort(2))
    told = [(r.attempt, r.verdict) for r in worker.transport.receipts["north-0"]]
    assert told[-2:] == [(1, "folded"), (1, "left_out")], told  # (a cold start says "pending" first)
    assert "abandoned attempt 1" in worker.transport.receipts["north-0"][-1].detail


def test_a_device_revoked_at_a_site_leaves_its_running_round_at_once(digits):
    """Its status cleared (`devices revoke` and `rotate` clear it), the site's round stops waiting for
    it: with every other selected device answered, the partial goes up then, not at the deadline."""
    settings = RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean", round_timeout=60)
    keys = {d: signing.new_key() for d in ("north-0", "north-1")}
    worker = SiteWorker(FED, "north", ARCH, signing.new_key(), keys)
    worker.transport = ReceiptsToo()  # type: ignore[assignment]
    task = messages.Task(1, 0, time.time() + 60, "fedavg", settings.task_hparams(1), {}, "float32", 1)
    site_task = SiteTask(1, 1, 2, messages.encode("task", task), site_rules(settings))
    worker._on_cohort(msgpack.packb({"site_task": encode_site_task(site_task), "devices": sorted(keys)},
                                    use_bin_type=True))
    worker.seen = {"north-0"}  # north-0 answered; north-1 is revoked before it does
    assert (1, 1) not in worker.sent
    worker._handle(topics.status(FED, "north-1"), b"", time.time(), True)
    assert worker.current.cohort == {"north-0"} and (1, 1) in worker.sent


@pytest.mark.parametrize("policy", ["stability", "random"])
def test_a_site_selects_its_cohort_with_the_rounds_selection_policy(policy):
    """The site task carries the round's `selection`; the site's leader draws its cohort with it from
    its eligible devices and their last metrics, as `select` would (the old worker always drew at
    random, whatever the coordinator was configured with)."""
    import random

    from broker_coordinator.engine.selection import is_stable, select
    from broker_coordinator.engine.site_aggregator import site_rules

    rules = site_rules(RoundSettings(selection=policy, aggregator="mean"))
    assert rules["selection"] == policy and rules["aggregator"] == "mean"
    worker = SiteWorker(FED, "north", ARCH, signing.new_key(), {}, seed=5)
    worker.transport = PublishedTo()  # type: ignore[assignment]
    devices = [f"north-{i}" for i in range(12)]
    for device in devices:
        worker.presence.on_status(device, messages.encode("status", messages.Status(device, "online", {"busy": False})))
    # eight devices whose last update was unstable (tau high, gamma low), four stable ones
    worker.intake.last_metrics = {d: {"tau": 0.5, "gamma": 0.2} if i < 8 else {"tau": 0.05, "gamma": 0.9}
                           for i, d in enumerate(devices)}
    task = messages.Task(1, 0, time.time() + 60, "drsam", {}, {}, "float32", 1)
    worker._on_site_task(encode_site_task(SiteTask(1, 1, 6, messages.encode("task", task), rules)))

    cohort = msgpack.unpackb(worker.transport.retained[f"edgefl/{FED}/site/north/cohort"])["devices"]
    expected = select(policy, devices, 6, random.Random("5/north"), worker.intake.last_metrics)
    assert cohort == sorted(expected) == sorted(worker.transport.tasked)
    if policy == "stability":  # half drawn uniformly, the rest from the stable devices first
        assert sum(is_stable(worker.intake.last_metrics[d]) for d in cohort) >= 3
        assert cohort != select("random", devices, 6, random.Random("5/north"), worker.intake.last_metrics)
    assert all(worker.presence.pending_round[d] == 1 for d in cohort)


def test_a_site_task_naming_an_unknown_selection_selects_at_random(caplog):
    import random

    from broker_coordinator.engine.selection import select

    worker = SiteWorker(FED, "north", ARCH, signing.new_key(), {}, seed=5)
    worker.transport = PublishedTo()  # type: ignore[assignment]
    devices = [f"north-{i}" for i in range(6)]
    for device in devices:
        worker.presence.on_status(device, messages.encode("status", messages.Status(device, "online", {"busy": False})))
    task = messages.Task(1, 0, time.time() + 60, "fedavg", {}, {}, "float32", 1)
    with caplog.at_level("ERROR"):
        worker._on_site_task(encode_site_task(SiteTask(1, 1, 3, messages.encode("task", task), {"selection": "best"})))
    assert any("selection 'best'" in r.getMessage() for r in caplog.records)
    assert sorted(worker.transport.tasked) == select("random", devices, 3, random.Random("5/north"), {})


def test_quotas_split_clients_over_sites_in_proportion():
    assert quotas(10, {"a": 30, "b": 10, "c": 0}) == {"a": 8, "b": 2}
    assert sum(quotas(1000, {"a": 2500, "b": 2500, "c": 2500, "d": 2499}).values()) == 1000
    assert quotas(0, {"a": 3, "b": 0}) == {"a": 0}
    assert quotas(50, {"a": 3, "b": 4}) == {"a": 3, "b": 4}


# over real brokers --------------------------------------------------------------------------------
class Device:
    """A device at its site: online status, and per task a signed update (recorded)."""

    def __init__(self, name: str, password: str, port: int, key: bytes, specs: dict) -> None:
        self.name, self.key, self.specs = name, key, specs
        self.sent: dict[int, bytes] = {}
        self.models: list[str] = []
        self.errors: list[BaseException] = []
        self.client = make_client(name, name, password)
        self.client.on_message = self._on_message
        self.client.will_set(topics.status(FED, name), b"", qos=1, retain=True)
        connect(self.client, "127.0.0.1", port, timeout=10)
        self.client.subscribe([(topics.task(FED, name), 1), (topics.models(FED), 1)])
        self.client.publish(topics.status(FED, name), messages.encode("status", messages.Status(name, "online")),
                            qos=1, retain=True).wait_for_publish(5)

    def _on_message(self, client, userdata, msg) -> None:
        try:
            if topics.parse_model_topic(msg.topic) is not None:
                self.models.append(msg.topic)
                return
            task = messages.decode_task(msg.payload)
            rng = np.random.default_rng([task.round, int(self.name.split("-")[1]), len(self.name)])
            payload = signed_update(self.name, self.key, task, self.specs, rng, 50 + 10 * len(self.sent))
            self.sent[task.round] = payload
            client.publish(topics.update(FED, self.name), payload, qos=1)
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_bridged_sites_run_rounds_and_two_workers_share_a_site(tmp_path, digits):
    """A central and two site brokers bridged; north has 2 workers on a $share subscription. The
    rounds' global models equal a flat federation's fold of the same updates; every update is
    folded by exactly one worker; the model reached the devices through their site broker."""
    where = {"north": [f"north-{i}" for i in range(4)], "south": ["south-0", "south-1"]}
    settings = RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean", norm_bound=0,
                             weighting="reported", round_timeout=20, min_updates=1)
    keys = {d: signing.new_key() for devices in where.values() for d in devices}
    stop = threading.Event()
    workers: list[SiteWorker] = []
    devices: list[Device] = []
    threads: list[threading.Thread] = []
    with LocalSites(tmp_path, FED, where, workers=2) as rig:
        tree = Engine(FED, ARCH, digits.test, settings,
                               sites={s: SiteSpec(2 if s == "north" else 1, rig.site_key(s)) for s in where})
        flat = Engine(FED, ARCH, digits.test, settings, device_keys=keys)
        try:
            tree.connect(rig.central.host, rig.central.port, COORDINATOR_USER, rig.coordinator_password)
            for site, names in where.items():
                for index in range(2 if site == "north" else 1):
                    worker = SiteWorker(FED, site, ARCH, rig.site_key(site), {d: keys[d] for d in names}, index)
                    worker.connect(rig.brokers[site].host, rig.brokers[site].port, *rig.worker_login(site, index))
                    workers.append(worker)
                    threads.append(threading.Thread(target=worker.serve, args=(stop,), daemon=True))
                    threads[-1].start()
                devices += [Device(d, rig.passwords[d], rig.brokers[site].port, keys[d], tree.specs) for d in names]
            tree.wait_for_devices(6, timeout=20)
            records = [tree.run_round() for _ in range(2)]
            for r in (1, 2):
                fold_round(flat, {d.name: d.sent[r] for d in devices})
        finally:
            stop.set()
            for thread in threads:
                thread.join(5)
            for worker in workers:
                worker.close()
            for device in devices:
                device.close()
            tree.close()
    assert not [e for d in devices for e in d.errors]
    assert [r.participants for r in records] == [6, 6] and [r.closed for r in records] == ["complete"] * 2
    assert [r.model_sha256 for r in records] != [r.base_sha256 for r in records]
    for name in flat.weights:
        np.testing.assert_allclose(tree.weights[name], flat.weights[name], rtol=1e-5, atol=1e-6)
    north = [w for w in workers if w.site == "north"]
    folded = [{(d, r) for d, r, _ in w.intake.accepted} for w in north]
    assert all(folded), "both north workers should have folded a share of the updates"
    assert not folded[0] & folded[1]
    assert folded[0] | folded[1] == {(d, r) for d in where["north"] for r in (1, 2)}
    assert all(f"{topics.ROOT}/{FED}/model/1" in d.models for d in devices), "model version 1 reached every site"


def test_generated_site_config_bridges_over_tls_with_least_privilege(tmp_path):
    """`broker-config --site north` against a central broker with TLS: the site's Mosquitto starts
    from the generated files, its bridge logs in over TLS as site-north; the retained model comes
    down, a partial goes up; site-south's bridge user can neither read north's task nor write its
    partials."""
    from broker_coordinator.access import devices as ops
    from broker_coordinator.access.broker import (
        find_mosquitto,
        free_port,
        wait_for_port,
    )
    from broker_coordinator.access.sites import bridge_password, worker_password
    from broker_coordinator.simulation.processes import stop_processes

    from .operator_fixtures import PROJECT_ROOT, start_server, stop_server
    from .test_enrollment import self_signed

    cert, key = self_signed(tmp_path / "pki")
    site_port = free_port()
    extra = (f'tls_cert = "{cert}"\ntls_key = "{key}"\ndevice_port = {free_port()}\n'
             f'[sites.north]\ndevices = "north-*"\nport = {site_port}\nbind = "127.0.0.1"\n'
             f'run_as = "{getpass.getuser()}"\n'
             f'[sites.south]\ndevices = "south-*"\n')
    server = start_server(tmp_path / "server", extra)
    site_proc = None
    clients, processes = [], []
    try:
        server.add("north-0")
        server.add("south-0")
        out = tmp_path / "north"
        done = server.cli("broker-config", "--site", "north", "--out", str(out))
        assert done.returncode == 0, done.stderr
        conf = (out / "mosquitto.conf").read_text()
        assert f"bridge_cafile {out}/central-ca.pem" in conf and "remote_username site-north" in conf
        assert f"address 127.0.0.1:{server.config.broker.devices_port}" in conf  # the TLS listener
        assert "north-0:" in (out / "passwd").read_text() and "south-0" not in (out / "passwd").read_text()
        log = tmp_path / "north.log"
        with open(log, "wb") as handle:
            site_proc = subprocess.Popen([find_mosquitto(), "-c", str(out / "mosquitto.conf")], stdout=handle,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for_port(site_port, site_proc, log)

        secret = server.config.broker.password
        central = Recorder(ops.coordinator_client(server.config, "t"))
        connect(central.client, "127.0.0.1", server.port, timeout=10)
        worker = Recorder(make_client("north-aggregator-0", "north-aggregator-0", worker_password(secret, "north")))
        connect(worker.client, "127.0.0.1", site_port, timeout=10)
        south = Recorder(make_client("site-south", "site-south", bridge_password(secret, "south")))
        connect(south.client, "127.0.0.1", server.port, timeout=10)
        clients += [central, worker, south]
        central.subscribe("edgefl/field/site/+/partial")
        south.subscribe("edgefl/field/site/north/task")  # denied by the ACL
        south.subscribe("edgefl/field/site/south/task")  # its own: where the marker below reaches it
        worker.subscribe("edgefl/field/model/#")
        central.client.publish("edgefl/field/model/7", b"manifest", qos=1, retain=True).wait_for_publish(5)
        central.client.publish("edgefl/field/site/north/task", b"task", qos=1).wait_for_publish(5)
        wait_until(lambda: ("edgefl/field/model/7", b"manifest") in worker.messages, 15, "the model at the site")
        south.client.publish("edgefl/field/site/north/partial", b"forged", qos=1).wait_for_publish(5)
        worker.client.publish("edgefl/field/site/north/partial", b"partial", qos=1).wait_for_publish(5)
        partials = lambda: [m for m in central.messages if m[0].endswith("/partial")]
        central.wait_for("edgefl/field/site/north/partial", b"partial")  # sent after the forged one
        flush(central, south, "edgefl/field/site/south/task")  # after north's task
        assert partials() == [("edgefl/field/site/north/partial", b"partial")]
        assert south.messages == []

        # the site's aggregator, from the generated config: its presence reaches the coordinator
        central.subscribe("edgefl/field/site/+/status")
        aggregator = subprocess.Popen([sys.executable, "-m", "broker_coordinator", "site-aggregator", "--config",
                                       str(out / "aggregator.toml")], cwd=PROJECT_ROOT,
                                      env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        processes.append(aggregator)
        wait_until(lambda: any(t == "edgefl/field/site/north/status" and p for t, p in central.messages), 60,
                   "the site aggregator's status at the central broker")
        status = messages.decode_status(next(p for t, p in central.messages if t.endswith("/north/status") and p))
        assert status.state == "online" and status.profile == {"online": 0, "eligible": 0, "samples": 0}
    finally:
        for recorder in clients:
            recorder.close()
        stop_processes(processes, timeout=10)
        if site_proc is not None:
            stop_processes([site_proc], timeout=10)
        stop_server(server)


def wait_until(predicate, within: float, what: str) -> None:
    give_up = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_config_names_sites_and_refuses_what_they_cannot_run(tmp_path):
    from broker_coordinator.settings.config import load_config
    from edgefl_protocol.settings import ConfigError
    base = '[federation]\ntest_data = "t.npz"\nmodel = "digits_mlp"\n[broker]\npassword = "x"\n'
    path = tmp_path / "c.toml"
    path.write_text(base + '[rounds]\naggregator = "median"\n[sites.north]\ndevices = "north-*, pi-07"\n')
    with pytest.raises(ConfigError, match='aggregator = one of centered_clip, mean'):
        load_config(path)
    path.write_text(base + '[sites.north]\ndevices = "north-*, pi-07"\n')  # the default fold runs in sites
    site = load_config(path).sites["north"]
    assert site.holds("north-3") and site.holds("pi-07") and not site.holds("south-1")
    path.write_text(base + '[sites.north]\ndevices = "north-*"\nworkers = 0\n')
    with pytest.raises(ConfigError, match=r"\[sites.north\]: workers must be 1-64"):
        load_config(path, with_rounds=False)
