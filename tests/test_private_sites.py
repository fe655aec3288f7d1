"""[privacy] mode = "central" through sites (aggregation/private_partials.py): the sites forward
clipped sums and the centre adds the noise, releasing what a flat round releases for the same
devices; the site tasks carry the clip and the sampling, the leaders draw with the CSPRNG; forged
partials are rejected; one `simulate --sites 2` run reports epsilon."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("dp_accounting")

from broker_coordinator.aggregation import privacy, private_partials  # noqa: E402
from broker_coordinator.aggregation.privacy import PrivateRound  # noqa: E402
from broker_coordinator.engine.loop import Engine  # noqa: E402
from broker_coordinator.settings.round_settings import RoundSettings  # noqa: E402
from broker_coordinator.engine.site_aggregator import SiteWorker, site_rules  # noqa: E402
from broker_coordinator.engine.tree import SiteSpec  # noqa: E402
from broker_coordinator.settings import composition  # noqa: E402
from broker_coordinator.settings.privacy_settings import PrivacySettings  # noqa: E402
from broker_coordinator.simulation.in_memory import fold_partials, fold_round  # noqa: E402
from edgefl_protocol import codec, messages, signing  # noqa: E402
from edgefl_protocol.errors import Rejected  # noqa: E402
from edgefl_protocol.site_partials import (  # noqa: E402
    SiteTask,
    decode_partial,
    encode_partial,
    encode_site_task,
)
from edgefl_models import datasets  # noqa: E402

from .test_sites import ARCH, FED, signed_update  # noqa: E402

WHERE = {**{f"north-{i}": "north" for i in range(5)}, **{f"south-{i}": "south" for i in range(4)}}


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits")


def _settings(**values):
    values = dict(mode="central", noise_multiplier=1.1, target_epsilon=1000.0, delta=1e-3, population=40,
                  clip="adaptive", clip_initial=0.1, **values)
    return RoundSettings(algorithm="fedavg", codec="float32", aggregator="mean", weighting="uniform", norm_bound=0,
                         clients_per_round=9, round_timeout=60, privacy=PrivacySettings(**values))


def _pair(digits, settings_of):
    keys = {d: signing.new_key() for d in WHERE}
    site_keys = {s: signing.new_key() for s in set(WHERE.values())}
    flat = Engine(FED, ARCH, digits.test, settings_of(), device_keys=keys)
    tree = Engine(FED, ARCH, digits.test, settings_of(), device_keys={},
                           sites={s: SiteSpec(2 if s == "north" else 1, k) for s, k in site_keys.items()})
    return flat, tree, keys, site_keys


def _site_partials(tree, keys, site_keys, task, payloads, rules):
    """north's two workers fold half of its devices each, south's one worker all of its own."""
    workers = {("north", 0): ["north-0", "north-2", "north-4"], ("north", 1): ["north-1", "north-3"],
               ("south", 0): [d for d in WHERE if d.startswith("south")]}
    site_task = SiteTask(task.round, 1, 0, messages.encode("task", task), rules)
    partials = []
    for (site, index), devices in workers.items():
        worker = SiteWorker(FED, site, ARCH, site_keys[site], keys, worker=index)
        rnd = worker.open(site_task, task, {d for d, s in WHERE.items() if s == site})
        assert isinstance(rnd.aggregate, PrivateRound) and rnd.aggregate.z_delta == 0.0
        for device in devices:
            worker.intake.on_update(rnd, device, payloads[device], time.time())
        partials.append((site, encode_partial(worker.partial(rnd), site_keys[site])))
    return partials


def test_sites_release_what_the_flat_round_releases(digits, monkeypatch):
    """The same updates flat and through 2 sites (3 workers): the same pre-noise clipped sum, count and
    unclipped count; with one seeded generator injected for the test, the same noisy mean, the same
    noisy unclipped fraction and next clip, the same epsilon."""
    flat, tree, keys, site_keys = _pair(digits, _settings)
    task = messages.Task(1, 0, time.time() + 60, "fedavg", flat.settings.task_hparams(1), {}, "float32", 1)
    rng = np.random.default_rng(4)
    payloads, norms = {}, []
    for device in WHERE:
        tensors = {n: (rng.uniform(0.1, 2.0) * rng.standard_normal(s)).astype(np.float32) for n, s in flat.specs.items()}
        norms.append(np.sqrt(sum(float(np.sum(np.square(a.astype(np.float64)))) for a in tensors.values())))
        enc = codec.encode(tensors, "float32")
        update = messages.Update(device, 1, 0, int(rng.integers(20, 200)), {"steps": int(rng.integers(1, 9))},
                                 enc.body, enc.codec, enc.specs, FED, 1)
        payloads[device] = messages.encode_update(update, keys[device])
    clip = float(np.median(norms))
    for coordinator in (flat, tree):
        coordinator.privacy.clip.clip = clip  # about half of the updates clipped
    released = []
    real_mean = PrivateRound.result

    def recorded(self, rng=None):
        released.append((self.clipped_sum(), self.count, self.unclipped))
        return real_mean(self, rng)

    monkeypatch.setattr(PrivateRound, "result", recorded)
    monkeypatch.setattr(privacy, "secure_generator", lambda: np.random.default_rng(11))
    rules = {**site_rules(tree.settings), **tree.privacy.site_privacy().rules()}
    assert rules["privacy"] == {"clip": clip, "sampling": "poisson", "rate": 9 / 40}
    partials = _site_partials(tree, keys, site_keys, task, payloads, rules)
    flat_record = fold_round(flat, payloads)
    tree_record = fold_partials(tree, {"north": 5, "south": 4}, partials)

    (flat_sum, flat_count, flat_unclipped), (tree_sum, tree_count, tree_unclipped) = released
    assert tree_count == flat_count == len(WHERE) and tree_unclipped == flat_unclipped
    assert 0 < flat_unclipped < len(WHERE), "the clip should leave some updates unclipped and clip others"
    for name in flat_sum:  # float32 on the wire: the partial's sum is rounded once
        np.testing.assert_allclose(tree_sum[name], flat_sum[name], rtol=1e-5, atol=1e-5)
    for name in flat.weights:
        np.testing.assert_allclose(tree.weights[name], flat.weights[name], rtol=1e-5, atol=1e-6)
    for key in ("epsilon", "versions", "noise_std", "clip", "next_clip", "unclipped_fraction"):
        assert tree_record.privacy[key] == pytest.approx(flat_record.privacy[key], rel=1e-9), key
    assert tree_record.privacy["next_clip"] != clip  # the adaptive clip moved, at the centre
    assert tree_record.participants == flat_record.participants == len(WHERE)
    assert "norm" not in tree_record.clipped  # how many were clipped is released only with noise
    assert tree.privacy.ledger.applied == flat.privacy.ledger.applied == 1


def test_the_leader_draws_poisson_with_the_csprng_not_its_seeded_generator(monkeypatch):
    rules = private_partials.SitePrivacy(0.5, "poisson", 0.5).rules()
    task = messages.Task(1, 0, time.time() + 60, "fedavg", RoundSettings().task_hparams(1), {}, "float32", 1)
    payload = encode_site_task(SiteTask(1, 1, 3, messages.encode("task", task), rules))
    draws = []

    class Counted(random.SystemRandom):
        def random(self):
            draws.append(1)
            return super().random()

    monkeypatch.setattr(private_partials.secrets, "SystemRandom", Counted)

    class Session:
        def publish_until(self, topic, payload, deadline, retain=False):
            return True

        def publish_all(self, messages_, deadline):
            return []

    cohorts = []
    for _ in range(2):  # two leaders with the same seed (the coordinator's): different draws
        worker = SiteWorker(FED, "north", ARCH, signing.new_key(), {}, worker=0, seed=0)
        worker.transport = Session()
        worker.presence.online = {f"north-{i:03d}": {} for i in range(200)}
        seeded = worker.rng.getstate()
        worker._on_site_task(payload)
        assert worker.rng.getstate() == seeded, "the seeded generator must not draw a private cohort"
        cohorts.append(set(worker.presence.pending_round))
    assert len(draws) == 400  # one CSPRNG draw per eligible device, the quota (3) ignored
    broken = encode_site_task(SiteTask(2, 1, 3, messages.encode("task", task), {"privacy": {"clip": -1.0}}))
    worker.presence.pending_round.clear()
    worker._on_site_task(broken)  # a private round is drawn and folded privately, or not at all
    assert worker.presence.pending_round == {}
    assert cohorts[0] != cohorts[1] and all(60 < len(c) < 140 for c in cohorts)


def test_fixed_sampling_in_sites_draws_the_quota_and_accounts_the_worst_site(digits):
    tree = Engine(FED, ARCH, digits.test, _settings(sampling="fixed"), device_keys={},
                           sites={"north": SiteSpec(1, b"k" * 32), "south": SiteSpec(1, b"k" * 32)})
    share = tree.privacy.site_shares({"north": 6, "south": 3}, {"north": 30, "south": 10})
    assert share == {"north": 6, "south": 3}
    assert (tree.privacy.sampling.population, tree.privacy.sampling.cohort) == (10, 3)  # 3/10 > 6/30
    site = private_partials.SitePrivacy(0.5, "fixed", 9 / 40)
    assert len(site.draw([f"d{i}" for i in range(10)], 3)) == 3
    poisson = Engine(FED, ARCH, digits.test, _settings(), device_keys={},
                              sites={"north": SiteSpec(1, b"k" * 32), "south": SiteSpec(1, b"k" * 32)})
    assert poisson.privacy.site_shares({"north": 9}, {"north": 30, "south": 1}) == {"north": 30, "south": 1}


def test_forged_private_partials_are_rejected(digits):
    _, tree, keys, site_keys = _pair(digits, _settings)
    task = messages.Task(1, 0, time.time() + 60, "fedavg", tree.settings.task_hparams(1), {}, "float32", 1)
    rng = np.random.default_rng(5)
    payloads = {d: signed_update(d, keys[d], task, tree.specs, rng, 50) for d in WHERE}
    rules = {**site_rules(tree.settings), **tree.privacy.site_privacy().rules()}
    site_task = SiteTask(1, 1, 0, messages.encode("task", task), rules)
    worker = SiteWorker(FED, "south", ARCH, site_keys["south"], keys)
    rnd = worker.open(site_task, task, {d for d, s in WHERE.items() if s == "south"})
    for device in ("south-0", "south-1"):
        worker.intake.on_update(rnd, device, payloads[device], time.time())
    honest = worker.partial(rnd)
    decode = lambda p: decode_partial(encode_partial(p, site_keys["south"]), site_keys["south"], "south",  # noqa: E731
                                      tree.specs, {}, 1 << 24)

    partial, sums = decode(honest)
    assert (partial.clip, partial.count) == (tree.privacy.clip.clip, 2)
    tree.privacy.tree_fold(tree.specs).check(partial, sums)  # the honest one passes
    with pytest.raises(Rejected, match="unclipped count 3 between 0 and its count 2"):
        decode(honest.__class__(**{**honest.__dict__, "unclipped": 3}))
    with pytest.raises(Rejected, match="not a private fold"):
        tree.privacy.tree_fold(tree.specs).check(*decode(honest.__class__(**{**honest.__dict__, "clip": 0.0})))
    with pytest.raises(Rejected, match="this round's clip"):
        tree.privacy.tree_fold(tree.specs).check(*decode(honest.__class__(**{**honest.__dict__, "clip": 9.0})))
    with pytest.raises(Rejected, match="weighs each"):
        tree.privacy.tree_fold(tree.specs).check(*decode(honest.__class__(**{**honest.__dict__, "total_weight": 5.0})))
    with pytest.raises(Rejected, match="above 1 x clip"):  # a sum of 2 deltas claimed as one
        tree.privacy.tree_fold(tree.specs).check(*decode(honest.__class__(**{**honest.__dict__, "count": 1,
                                                                            "total_weight": 1.0,
                                                                            "weighted_steps": 1.0,
                                                                            "unclipped": 0})))
    # through the coordinator: the forged one is counted as rejected, the honest one folded
    forged = honest.__class__(**{**honest.__dict__, "worker": 0, "site": "north", "clip": 9.0})
    record = fold_partials(tree, {"north": 5, "south": 4},
                           [("north", encode_partial(forged, site_keys["north"])),
                            ("south", encode_partial(honest, site_keys["south"]))])
    assert record.rejected.get("not_private") == 1 and record.participants == 2


def test_privacy_composes_in_sites_and_in_buffered_mode():
    assert not composition.refusals(_settings(), "sites")
    assert [r.combination for r in composition.refusals(_settings(), "flat")] == []
    buffered = RoundSettings(mode="buffered", algorithm="fedavg", aggregator="mean", weighting="uniform",
                             privacy=PrivacySettings(mode="central", noise_multiplier=1.0))
    assert composition.refusals(buffered, "flat") == [] and composition.refusals(buffered, "sites") == []


def test_simulate_in_sites_reports_epsilon_in_history(tmp_path):
    config = tmp_path / "sim.toml"
    config.write_text('[rounds]\nalgorithm = "fedavg"\nclients_per_round = 3\nmin_updates = 1\n'
                      '[privacy]\nmode = "central"\nnoise_multiplier = 0.5\ntarget_epsilon = 1000.0\n'
                      'delta = 0.01\nclip = 1.0\n')
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--agents", "4", "--rounds", "2",
                             "--sites", "2", "--dataset", "digits", "--out", str(out), "--config", str(config)],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rounds = json.loads((out / "history.json").read_text())["rounds"]
    assert len(rounds) == 2, result.stdout
    epsilons = [r["privacy"]["epsilon"] for r in rounds]
    assert all(e > 0 for e in epsilons) and epsilons == sorted(epsilons)
    assert all(r["privacy"]["population"] == 4 and r["privacy"]["clip"] == 1.0 for r in rounds)
