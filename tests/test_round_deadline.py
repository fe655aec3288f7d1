"""A round's deadline starts when the round opens, not when the coordinator began waiting for its
quorum. A fresh federation's coordinator starts before its devices: it waits up to `round_timeout`
for a quorum, and it used to open the round with what was left of that wait, so devices that came
online late in it got a task with seconds to spare, and the model's first release had to be
published within them ("could not publish model version 0 before the deadline", one round_timeout
lost). In process (the in-memory transport: a broker would only add its own delays)."""

from __future__ import annotations

import threading
import time

import pytest

from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.rounds import RoundFailed, RoundState
from broker_coordinator.engine.transport import InMemoryTransport
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_models import datasets
from edgefl_protocol import messages, signing, topics

FED = "deadline"
DEVICES = ("d1", "d2")
TIMEOUT = 3.0
LATE = 2.2  # seconds into the quorum wait when the devices come online


def test_a_round_opened_after_waiting_for_its_quorum_has_its_whole_round_timeout():
    settings = RoundSettings(algorithm="fedavg", codec="float32", round_timeout=TIMEOUT, min_updates=2,
                             max_attempts=1)
    engine = Engine(FED, "digits_mlp", datasets.load("digits").test, settings,
                    device_keys={d: signing.new_key() for d in DEVICES})
    engine.transport = InMemoryTransport()
    opened: list[tuple[float, float]] = []  # (when the round opened, its deadline)
    came_online = threading.Event()

    def on_state(rnd) -> None:  # noqa: ANN001
        if rnd.state == RoundState.OPEN and not opened:
            opened.append((time.time(), rnd.deadline))
            engine.stopping.set()  # what is measured is the deadline it opened with: end the round here

    def online() -> None:
        for device in DEVICES:
            engine.transport.deliver(topics.status(FED, device),
                                     messages.encode("status", messages.Status(device, "online", {})), True)
        came_online.set()

    engine.on_state = on_state
    timer = threading.Timer(LATE, online)
    timer.start()
    try:
        with pytest.raises(RoundFailed):  # abandoned: the test stops the coordinator once the round is open
            engine.run_round(1)
    finally:
        timer.cancel()
    assert came_online.is_set() and opened, "the round never opened"
    when, deadline = opened[0]
    assert deadline - when >= TIMEOUT - 0.5, (
        f"the round opened {when - (deadline - TIMEOUT):.1f} s into its own deadline's window")
