"""Buffered versions through sites: a site task is a ticket; a partial answers an open ticket of its
site once per worker, for the version the task named, at most S versions behind, and counts with
the staleness factor of that version (FedBuff's damping, per partial)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.engine.buffered import BufferedVersions, Ticket
from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.engine.sync_rounds import SyncRounds
from broker_coordinator.engine.tree import Sites, SiteSpec
from edgefl_protocol import signing
from edgefl_protocol.site_partials import encode_partial, make_partial
from edgefl_models import datasets

FED = "test"
KEYS = {"north": signing.new_key(), "south": signing.new_key()}


@pytest.fixture()
def tree():
    settings = RoundSettings(algorithm="fedavg", mode="buffered", aggregator="mean", norm_bound=0, codec="float32",
                             weighting="uniform", buffer_size=4, max_staleness=1, round_timeout=60)
    return Engine(FED, "digits_mlp", datasets.load("digits").test, settings, device_keys={},
                                   sites={"north": SiteSpec(2, KEYS["north"]), "south": SiteSpec(1, KEYS["south"])})


def _partial(tree, site: str, worker: int, key: tuple[int, int], version: int, value: float, count: int = 2) -> bytes:
    stream = StreamingMean(tree.specs)
    for _ in range(count):
        stream.add({n: np.full(s, value, dtype=np.float32) for n, s in tree.specs.items()}, 1.0)
    return encode_partial(make_partial(FED, site, worker, *key, version, stream, None), KEYS[site])


def _ticket(tree, site: str, key: tuple[int, int], version: int) -> None:
    tree.schedule.tickets[key] = Ticket(site, version, time.time() + 60)
    tree.schedule.working[site] = key


def test_the_sites_topology_runs_the_configured_schedule():
    sites = {"a": SiteSpec(1, b"k" * 32)}
    buffered = Engine(FED, "digits_mlp", None, RoundSettings(mode="buffered", algorithm="fedavg", buffer_size=2),
                      sites=sites)
    assert isinstance(buffered.schedule, BufferedVersions) and isinstance(buffered.topology, Sites)
    sync = Engine(FED, "digits_mlp", None, RoundSettings(), sites=sites)
    assert isinstance(sync.schedule, SyncRounds) and isinstance(sync.topology, Sites)


def test_a_ticket_is_done_when_every_worker_of_its_site_answered(tree):
    buffer = tree.schedule.open_buffer(tree, 1)
    _ticket(tree, "north", (1, 1), 0)
    tree.topology.on_partial(tree, buffer, "north", _partial(tree, "north", 0, (1, 1), 0, 0.1))
    assert tree.schedule.working == {"north": (1, 1)}, "one of north's two workers has not answered: its task is out"
    tree.topology.on_partial(tree, buffer, "north", _partial(tree, "north", 0, (1, 1), 0, 0.1))  # the same worker again
    tree.topology.on_partial(tree, buffer, "north", _partial(tree, "north", 1, (1, 1), 0, 0.1))
    assert tree.intake.rejections == {"duplicate": 1} and buffer.aggregate.count == 4
    assert "north" not in tree.schedule.working and (1, 1) not in tree.schedule.tickets  # free for its next task


def test_partials_to_no_open_ticket_or_too_stale_versions_are_rejected_with_their_reason(tmp_path, tree):
    buffer = tree.schedule.open_buffer(tree, 3)
    tree.version = 3
    tree.topology.on_partial(tree, buffer, "south", _partial(tree, "south", 0, (3, 1), 3, 0.1))  # no such task
    _ticket(tree, "north", (3, 2), 3)
    tree.topology.on_partial(tree, buffer, "south", _partial(tree, "south", 0, (3, 2), 3, 0.1))  # north's task
    _ticket(tree, "south", (3, 3), 1)  # sent two versions ago; max_staleness is 1
    tree.topology.on_partial(tree, buffer, "south", _partial(tree, "south", 0, (3, 3), 1, 0.1))
    assert tree.intake.rejections == {"stale": 2, "too_stale": 1} and buffer.aggregate.count == 0
    assert "south" not in tree.schedule.working  # its task was answered, however: it may get the next one


def test_a_stale_partial_counts_with_its_versions_staleness_factor(tree):
    buffer = tree.schedule.open_buffer(tree, 2)
    tree.version = 1
    _ticket(tree, "south", (2, 1), 1)  # fresh
    _ticket(tree, "north", (2, 2), 0)  # one version behind: factor 1 / sqrt(2)
    tree.topology.on_partial(tree, buffer, "south", _partial(tree, "south", 0, (2, 1), 1, 1.0))
    tree.topology.on_partial(tree, buffer, "north", _partial(tree, "north", 0, (2, 2), 0, 1.0))
    tree.topology.on_partial(tree, buffer, "north", _partial(tree, "north", 1, (2, 2), 0, 1.0))
    assert not tree.intake.rejections and buffer.aggregate.count == 6
    factor = 1 / math.sqrt(2)
    step = buffer.aggregate.result()
    expected = (2 * 1.0 + 4 * factor) / 6  # FedBuff: sum f(s) n delta / sum n
    for name, a in step.items():
        np.testing.assert_allclose(a, expected, rtol=1e-6)
    assert buffer.aggregate.report().damping == pytest.approx((2 + 4 * factor) / 6)
    assert buffer.device_metrics["north/1"]["staleness"] == 1
