"""Rounds without a broker: the engine's own intake, trust bounds, fold and server rule, fed the
signed payloads a benchmark or a test produced (`bench/inmemory.py` drives whole federations
through it). The answers go through exactly the code a round over MQTT runs; only the transport
is a function call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from broker_coordinator.engine.coordinator import Coordinator, RoundFailed
from broker_coordinator.engine.rounds import RoundState
from broker_coordinator.engine.tree import TreeCoordinator
from broker_coordinator.settings.round_settings import RoundRecord
from broker_coordinator.storage.store import model_sha256


def fold_round(coordinator: Coordinator, answers: Mapping[str, bytes], round_no: int | None = None) -> RoundRecord:
    """A round without a broker: the answers (device -> signed payload, as published) go through
    the same validation, trust bounds and fold as over MQTT. For benchmarks and tests."""
    round_no = round_no or coordinator.next_round
    base_sha = model_sha256(coordinator.weights)
    rnd = coordinator._open_round(round_no, 1, set(answers), time.time() + coordinator.settings.round_timeout,
                                 len(answers))
    rnd.move(RoundState.COLLECTING)
    for device, payload in answers.items():
        coordinator._on_update(rnd, device, payload, time.time())
    if rnd.aggregate.count == 0:
        rnd.move(RoundState.ABANDONED, "no update was accepted")
        raise RoundFailed(f"round {round_no}: no update was accepted ({dict(rnd.rejected)})")
    rnd.move(RoundState.CLOSED)
    return coordinator._conclude(rnd, base_sha)


def fold_partials(tree: TreeCoordinator, shares: Mapping[str, int], payloads: list[tuple[str, bytes]],
                  round_no: int | None = None) -> RoundRecord:
    """A round without a broker: the partials (site, signed payload), as the sites would send them
    for site tasks with these `shares`, through the same validation and combination as over MQTT.
    For tests and benchmarks (the pair of `fold_round`)."""
    round_no = round_no or tree.next_round
    base_sha = model_sha256(tree.weights)
    expected = {f"{site}/{w}" for site in shares for w in range(tree.sites[site].workers)}
    rnd = tree._open_round(round_no, 1, expected, time.time() + tree.settings.round_timeout, sum(shares.values()))
    rnd.aggregate = tree.tree_sum(round_no, shares)  # type: ignore[assignment]
    tree.extras = rnd.aggregate.extras
    rnd.move(RoundState.COLLECTING)
    for site, payload in payloads:
        tree._on_partial(rnd, site, payload)
    if rnd.aggregate.count == 0:
        rnd.move(RoundState.ABANDONED, "no update was folded")
        raise RoundFailed(f"round {round_no}: no partial carried an update ({dict(rnd.rejected)})")
    rnd.move(RoundState.CLOSED)
    return tree._conclude(rnd, base_sha)
