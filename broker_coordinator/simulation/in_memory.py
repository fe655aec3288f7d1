"""Rounds without a broker: the engine's own loop parts fed through its in-memory transport.

The answers a benchmark or a test produced (signed payloads, as devices or sites publish them) are
delivered to the engine's `InMemoryTransport` on the topics a broker would carry them on, and the
engine drains them exactly as over MQTT: topology, intake, trust bounds, fold, receipts. Only the
cohort is the caller's (a benchmark chooses which devices train) and the round closes when every
answer is in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.rounds import Round, RoundFailed, RoundState
from broker_coordinator.engine.transport import InMemoryTransport
from broker_coordinator.engine.tree import Sites
from broker_coordinator.settings.round_settings import RoundRecord
from broker_coordinator.storage.store import model_sha256
from edgefl_protocol import topics


def fold_round(engine: Engine, answers: Mapping[str, bytes], round_no: int | None = None) -> RoundRecord:
    """A round without a broker: the answers (device -> signed payload, as published) go through
    the same validation, trust bounds and fold as over MQTT. For benchmarks and tests."""
    round_no = round_no or engine.next_round
    base_sha = model_sha256(engine.weights)
    rnd = engine.open_round(round_no, 1, set(answers), time.time() + engine.settings.round_timeout, len(answers))
    _deliver(engine, rnd, [(topics.update(engine.fed, device), payload) for device, payload in answers.items()])
    if rnd.aggregate.count == 0:
        rnd.move(RoundState.ABANDONED, "no update was accepted")
        raise RoundFailed(f"round {round_no}: no update was accepted ({dict(rnd.rejected)})")
    rnd.move(RoundState.CLOSED)
    return engine.conclude(rnd, base_sha)


def fold_partials(engine: Engine, shares: Mapping[str, int], payloads: list[tuple[str, bytes]],
                  round_no: int | None = None) -> RoundRecord:
    """A round without a broker: the partials (site, signed payload), as the sites would send them
    for site tasks with these `shares`, through the same validation and combination as over MQTT.
    For tests and benchmarks (the pair of `fold_round`)."""
    sites = engine.topology
    if not isinstance(sites, Sites):
        raise TypeError("fold_partials needs an engine of a federation in sites (Engine(..., sites=...))")
    round_no = round_no or engine.next_round
    base_sha = model_sha256(engine.weights)
    expected = {f"{site}/{w}" for site in shares for w in range(sites.sites[site].workers)}
    rnd = engine.open_round(round_no, 1, expected, time.time() + engine.settings.round_timeout,
                            sum(shares.values()), lambda: sites.fold(engine, round_no, shares))
    _deliver(engine, rnd, [(topics.site_topic(engine.fed, site, "partial"), payload) for site, payload in payloads])
    if rnd.aggregate.count == 0:
        rnd.move(RoundState.ABANDONED, "no update was folded")
        raise RoundFailed(f"round {round_no}: no partial carried an update ({dict(rnd.rejected)})")
    rnd.move(RoundState.CLOSED)
    return engine.conclude(rnd, base_sha)


def _deliver(engine: Engine, rnd: Round, messages: list[tuple[str, bytes]]) -> None:
    """Every message through the transport's inbox, handled as the engine handles a broker's."""
    transport = engine.transport
    if not isinstance(transport, InMemoryTransport):
        raise TypeError("rounds without a broker need the engine's in-memory transport (Engine(transport=None))")
    rnd.move(RoundState.COLLECTING)
    for topic, payload in messages:
        transport.deliver(topic, payload)
    while not transport.inbox.empty():
        engine.drain(0.0, rnd)
