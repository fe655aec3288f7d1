"""What the trust stages say to the operator: a down-weighted update is routine (its verdict and the
round record say it, at INFO or below); a device whose standing reaches the floor is said once, at
WARNING. Through the engine's intake and fold (simulation/in_memory.py); no broker."""

from __future__ import annotations

import logging

import numpy as np

from broker_coordinator.engine.loop import Engine
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.in_memory import fold_round
from edgefl_models import datasets
from edgefl_protocol import codec, messages, signing

FED, ARCH = "test", "digits_mlp"
DEVICES = [f"h{i}" for i in range(7)] + ["x0"]


def test_a_device_at_the_floor_is_said_once_at_warning_and_routine_verdicts_are_not(caplog):
    settings = RoundSettings(algorithm="fedavg", codec="float32", weighting="uniform", round_timeout=60)
    keys = {d: signing.new_key() for d in DEVICES}
    coordinator = Engine(FED, ARCH, datasets.load("digits").test, settings, device_keys=keys)
    rng = np.random.default_rng(3)
    task = {n: rng.standard_normal(s).astype(np.float32) for n, s in coordinator.specs.items()}
    with caplog.at_level(logging.INFO, logger="broker_coordinator"):
        for round_no in range(1, 9):
            payloads = {}
            for device in DEVICES:
                delta = {n: 0.01 * (a + rng.standard_normal(a.shape)).astype(np.float32) for n, a in task.items()}
                if device == "x0":
                    delta = {n: -3 * a for n, a in delta.items()}
                encoded = codec.encode(delta, "float32")
                update = messages.Update(device, round_no, coordinator.version, 50, {"steps": 1}, encoded.body,
                                         encoded.codec, encoded.specs, FED, 1)
                payloads[device] = messages.encode_update(update, keys[device])
            record = fold_round(coordinator, payloads, round_no)
    assert "weight_share" in record.devices["x0"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    floor = [w for w in warnings if "the least a device keeps" in w]
    assert len(floor) == 1 and "x0" in floor[0], warnings
    assert not any(d in w for w in warnings for d in DEVICES if d != "x0")  # honest devices: never a warning
