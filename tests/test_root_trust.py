"""[fold] root_trust: each update weighs its cosine with the update the coordinator trains on its
root data (FLTrust), at the centre and, carried by the site task, at the sites; refused where it
cannot compose. The engine paths go through the same intake and fold as over MQTT
(simulation/in_memory.py); no broker."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.aggregation.trust import NormBound
from broker_coordinator.engine.loop import Engine
from broker_coordinator.engine.site_aggregator import SiteWorker, site_rules
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.in_memory import fold_round
from edgefl_models import datasets
from edgefl_protocol import codec, messages, signing
from edgefl_protocol.site_partials import SiteTask, decode_site_task, encode_center, encode_site_task

FED, ARCH = "test", "digits_mlp"
SETTINGS = RoundSettings(algorithm="fedavg", codec="float32", weighting="uniform", norm_bound=0, round_timeout=60,
                         root_trust=True)
HONEST, ATTACKERS = [f"h{i}" for i in range(6)], ["x0", "x1"]


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


@pytest.fixture(scope="module")
def root(digits):
    return digits.train.subset(np.arange(200))


def test_an_update_weighs_its_cosine_with_the_root_update_and_one_pointing_away_is_left_out():
    rng = np.random.default_rng(1)
    direction = rng.standard_normal(50).astype(np.float32)
    updates = {"near": direction + 0.3 * rng.standard_normal(50).astype(np.float32),
               "far": direction + 3.0 * rng.standard_normal(50).astype(np.float32),
               "away": -direction}
    rnd = RobustRound({"w": (50,)}, NormBound(multiplier=0), "mean", trust=lambda names: direction)
    for device, delta in updates.items():
        rnd.add(device, {"w": delta}, 1.0)
    cos = {d: float(u @ direction / np.linalg.norm(u) / np.linalg.norm(direction)) for d, u in updates.items()}
    expected = (cos["near"] * updates["near"] + cos["far"] * updates["far"]) / (cos["near"] + cos["far"])
    np.testing.assert_allclose(rnd.result()["w"], expected, rtol=1e-5)
    report = rnd.report()
    assert report.gated == {"away": pytest.approx(-1.0)} and report.gated_by == "the root update"
    assert report.discounted["far"][0] == pytest.approx(cos["far"], rel=1e-5)
    assert "root update" in report.discounted["far"][1]


def test_a_round_whose_every_update_points_away_from_the_root_update_leaves_the_model_where_it_is():
    direction = np.ones(8, np.float32)
    rnd = RobustRound({"w": (8,)}, NormBound(multiplier=0), "centered_clip", trust=lambda names: direction)
    for i in range(3):
        rnd.add(f"x{i}", {"w": -direction}, 1.0)
    np.testing.assert_array_equal(rnd.result()["w"], np.zeros(8, np.float32))
    assert set(rnd.report().gated) == {"x0", "x1", "x2"}


@pytest.mark.parametrize("changes, refused", [
    ({"aggregator": "median"}, "root_trust + aggregator"),
    ({"privacy": PrivacySettings(mode="central", noise_multiplier=1.0, clip=1.0)}, "privacy central + root_trust"),
])
def test_root_trust_is_refused_where_it_cannot_compose(changes, refused):
    with pytest.raises(ValueError, match=refused.replace("+", r"\+")):
        RoundSettings(root_trust=True, **changes).validate()


def test_root_trust_needs_root_data(digits):
    with pytest.raises(ValueError, match=r"root_trust = true needs .*\[federation\] root_data"):
        Engine(FED, ARCH, digits.test, SETTINGS)


def _signed(keys: dict, tensors: dict[str, dict[str, np.ndarray]], round_no: int, version: int) -> dict[str, bytes]:
    out = {}
    for device, delta in tensors.items():
        encoded = codec.encode(delta, "float32")
        update = messages.Update(device, round_no, version, 50, {"steps": 1}, encoded.body, encoded.codec,
                                 encoded.specs, FED, 1)
        out[device] = messages.encode_update(update, keys[device])
    return out


def _round_against(root_step: dict[str, np.ndarray], seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Honest devices near the root update (their own data's part added), attackers its reverse."""
    rng = np.random.default_rng(seed)
    out = {d: {n: (a + 0.5 * float(np.std(a)) * rng.standard_normal(a.shape)).astype(np.float32)
               for n, a in root_step.items()} for d in HONEST}
    out |= {d: {n: (-a).astype(np.float32) for n, a in root_step.items()} for d in ATTACKERS}
    return out


def test_the_coordinator_leaves_out_updates_pointing_away_from_its_root_update_and_says_why(digits, root):
    keys = {d: signing.new_key() for d in HONEST + ATTACKERS}
    coordinator = Engine(FED, ARCH, digits.test, SETTINGS, device_keys=keys, root_set=root)
    step = coordinator.root_step(1)
    assert coordinator.root_step(1) is step  # trained once per model version
    record = fold_round(coordinator, _signed(keys, _round_against(step, 1), 1, coordinator.version), 1)
    for device in ATTACKERS:
        assert "direction" in record.devices[device]["left_out"]
    for device in HONEST:
        assert "left_out" not in record.devices[device]
        assert "root update" in record.devices[device]["weight_share"]
    assert record.clipped.get("direction") == len(ATTACKERS)
    assert coordinator.root_step(2) is not step  # a new version, a new root update


def test_a_site_scores_its_devices_against_the_root_update_its_task_carries(digits, root, caplog):
    keys = {d: signing.new_key() for d in HONEST + ATTACKERS}
    coordinator = Engine(FED, ARCH, digits.test, SETTINGS, root_set=root)
    step = coordinator.root_step(1)
    task = messages.Task(1, 0, time.time() + 60, "fedavg", SETTINGS.task_hparams(1), {}, "float32", 1)
    site_task = SiteTask(1, 1, 0, messages.encode("task", task), site_rules(SETTINGS), *encode_center(None),
                         *encode_center(step))
    site_task = decode_site_task(encode_site_task(site_task), 1 << 24)  # through the wire
    worker = SiteWorker(FED, "north", ARCH, signing.new_key(), keys)
    rnd = worker.open(site_task, task, set(keys))
    for device, payload in _signed(keys, _round_against(step, 2), 1, 0).items():
        worker.intake.on_update(rnd, device, payload, time.time())
    report = rnd.aggregate.report()
    assert set(report.gated) == set(ATTACKERS) and report.gated_by == "the root update"
    # a site task that should carry the root update and does not: said, and folded without the score
    bare = SiteTask(2, 1, 0, messages.encode("task", task), site_rules(SETTINGS))
    with caplog.at_level(logging.ERROR):
        rnd = worker.open(bare, task, set(keys))
    assert rnd.aggregate.trust is None
    assert "root_trust is on but the site task's root update is missing" in caplog.text


def test_a_coordinator_with_root_data_weighs_real_agents_updates_by_the_root_update(tmp_path):
    """End to end: Mosquitto with auth and ACLs, `broker-coordinator run` from a config that names
    root_data and root_trust, three real agents: every verdict says what the root update made of it."""
    import sqlite3

    from .test_tasks_e2e import start_federation, stop_federation, synthetic, trained_rounds

    fed = start_federation(tmp_path)
    try:
        x, y = synthetic(150, seed=99)  # the operator's trusted set: drawn like the devices' data
        np.savez(fed.server.root / "root.npz", x=x, y=y)
        text = fed.config.read_text().replace("[federation]", f'[federation]\nroot_data = "{fed.server.root / "root.npz"}"', 1)
        text = (text.replace("[fold]", "[fold]\nroot_trust = true", 1) if "[fold]" in text
                else text + "\n[fold]\nroot_trust = true\n")
        fed.config.write_text(text)
        fed.run(2)
        assert len(trained_rounds(fed.state)) == 2
        db = sqlite3.connect(fed.state / "coordinator.db")
        details = [d for (d,) in db.execute("SELECT verdict_detail FROM device_rounds WHERE accepted = 1")]
        db.close()
        assert details and all("root update" in (d or "") for d in details), details
    finally:
        stop_federation(fed)
