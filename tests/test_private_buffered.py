"""[privacy] in buffered mode: each applied version is one private release accounted at rate 1
(no amplification by sampling: who lands in a buffer depends on arrival times), the clipped sum is
divided by K, and a device lands at most once in a buffer, so its sensitivity stays C."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

pytest.importorskip("dp_accounting")

from broker_coordinator.aggregation.accountant import Accountant, Sampling  # noqa: E402
from broker_coordinator.engine.buffered import Ticket  # noqa: E402
from broker_coordinator.engine.loop import Engine  # noqa: E402
from broker_coordinator.settings.round_settings import RoundSettings  # noqa: E402
from broker_coordinator.engine.rounds import RoundState  # noqa: E402
from broker_coordinator.settings.privacy_settings import PrivacySettings  # noqa: E402
from edgefl_protocol import messages  # noqa: E402
from edgefl_models import datasets  # noqa: E402

KEY = b"unit-test-key-0123456789abcdef01"
DEVICES = [f"d{i}" for i in range(6)]
Z, DELTA = 1.2, 1e-5


class FakeSession:
    def __init__(self):
        self.tasked = []

    def publish(self, topic, payload, qos=1, retain=False):
        pass

    def publish_until(self, topic, payload, deadline, retain=False):
        return True

    def publish_all(self, messages_, deadline, qos=1):
        self.tasked += [topic.split("/")[3] for topic, _ in messages_]
        return []


def _coordinator(**privacy):
    s = RoundSettings(algorithm="fedavg", codec="float32", mode="buffered", aggregator="mean", buffer_size=3,
                      max_staleness=2, privacy=PrivacySettings(mode="central", noise_multiplier=Z, delta=DELTA,
                                                               clip=1.0, population=len(DEVICES), **privacy))
    c = Engine("u", "digits_mlp", datasets.load("digits").test, s, device_keys={d: KEY for d in DEVICES})
    return c, c.schedule.open_buffer(c, 1)


def _answer(c, device, attempt, value):
    tensors = {k: np.full_like(v, value) for k, v in c.weights.items()}
    specs = [[k, list(v.shape)] for k, v in tensors.items()]
    body = msgpack.packb([np.ascontiguousarray(v, "<f4").tobytes() for v in tensors.values()])
    return messages.encode_update(messages.Update(device, 1, 0, 10, {"steps": 1}, body, "float32", specs, "u",
                                                  attempt), KEY)


def _task(c, device, attempt):
    c.schedule.tickets[(1, attempt)] = Ticket(device, 0, time.time() + 60)
    c.schedule.working[device] = (1, attempt)


def test_a_buffered_version_is_one_release_at_rate_1_over_k_and_a_device_lands_once():
    c, buffer = _coordinator()
    assert c.privacy.cohort_size == 3 and c.privacy.sampling.rate == 1.0
    _task(c, "d0", 1)
    c.intake.on_update(buffer, "d0", _answer(c, "d0", 1, 0.01), time.time())
    c.transport, c.presence_settled = FakeSession(), True
    c.presence.online = {d: {} for d in DEVICES}
    c.topology.dispatch(c, c.schedule, buffer)
    assert "d0" not in c.transport.tasked and set(c.transport.tasked) == set(DEVICES[1:]), \
        "a device with an update in the buffer gets no second task"
    _task(c, "d0", 99)  # had it been tasked anyway: its second update is refused, not folded
    c.intake.on_update(buffer, "d0", _answer(c, "d0", 99, 0.01), time.time())
    assert c.intake.rejections == {"duplicate": 1} and buffer.aggregate.count == 1
    for attempt, device in ((2, "d1"), (3, "d2")):
        _task(c, device, attempt)
        c.intake.on_update(buffer, device, _answer(c, device, attempt, 0.01), time.time())
    assert buffer.aggregate.count == 3
    c.set_state(buffer, RoundState.CLOSED)
    record = c.conclude(buffer, "")
    expected = Accountant("rdp").epsilon([(Sampling("poisson", len(DEVICES), len(DEVICES)), Z, 1)], DELTA)
    assert record.privacy["epsilon"] == pytest.approx(expected, rel=1e-6) and record.privacy["cohort"] == 3
    assert record.privacy["noise_std"] == pytest.approx(c.privacy.z_delta * 1.0 / 3)


def test_buffered_privacy_refuses_fixed_sampling_with_the_reason():
    with pytest.raises(ValueError, match='buffered mode draws none'):
        _coordinator(sampling="fixed")
