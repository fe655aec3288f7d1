"""The attack benchmark's federation in sites: the devices of `bench.inmemory` grouped into sites,
each served by a real `SiteWorker` (intake, trust bounds, the round's streaming fold), whose
signed partials the `TreeCoordinator` combines (`fold_partials`). Only the brokers are left out.

A compromised site aggregator holds the site's key: it folds its devices as usual and then sends
a forged partial instead, correctly signed (its mean step -10x, its weight 100x, claiming every
device of its site).
"""

from __future__ import annotations

import math
import time

import numpy as np

from broker_coordinator.engine.rounds import RoundFailed
from broker_coordinator.engine.site_aggregator import SiteWorker, site_rules
from broker_coordinator.engine.tree import SiteSpec, quotas, site_tensors
from broker_coordinator.engine.loop import Engine
from broker_coordinator.simulation.in_memory import fold_partials
from edgefl_protocol import codec, messages, signing, topics
from edgefl_protocol.site_partials import SiteTask, encode_partial

from .inmemory import FED, InMemoryFederation


class InSites:
    def __init__(self, sim: InMemoryFederation, sites: int, compromised: bool = False) -> None:
        self.sim = sim
        names = [f"site-{k}" for k in range(sites)]
        self.where = {d: names[i % sites] for i, d in enumerate(sim.devices)}
        self.members = {s: [d for d in sim.devices if self.where[d] == s] for s in names}
        self.site_keys = {s: signing.new_key() for s in names}
        self.tree = Engine(FED, sim.arch, sim.test, sim.settings, seed=sim.seed, device_keys={}, root_set=sim.root,
                           sites={s: SiteSpec(1, self.site_keys[s], len(self.members[s])) for s in names})
        sim.coordinator = self.tree  # the devices train from the tree's model and server rule
        self.workers = {s: SiteWorker(FED, s, sim.arch, self.site_keys[s], {d: sim.keys[d] for d in self.members[s]},
                                      seed=sim.seed) for s in names}
        self.compromised = names[-1] if compromised else None
        self.forged = 0

    def round(self, round_no: int):
        sim, tree, s = self.sim, self.tree, self.sim.settings
        shares = quotas(s.clients_per_round, {site: len(m) for site, m in self.members.items()})
        hp = s.task_hparams(round_no)
        cohorts = {site: sorted(sim.rng.sample(self.members[site], k)) for site, k in shares.items()}
        trained = {d: sim.train(d, round_no, hp) for cohort in cohorts.values() for d in cohort}
        task = messages.Task(round_no, tree.version, time.time() + 600, s.algorithm, hp, tree.server_rule.broadcast(),
                             tree.settings.codec, 1, tree.objective.task, tree.objective.loss, evaluate=False,
                             train=True)  # the tree's codec: "auto" resolved for the model
        tensors = site_tensors(tree, round_no)  # the centre and the root update, as the tree codes them
        payloads = []
        for site, cohort in cohorts.items():
            site_task = SiteTask(round_no, 1, len(cohort), messages.encode("task", task), site_rules(s),
                                 *tensors)
            worker = self.workers[site]
            rnd = worker.current = worker.open(site_task, task, set(cohort))
            for device in cohort:  # through the worker's in-memory transport, as its broker would hand them over
                worker.transport.deliver(topics.update(FED, device), trained[device].payload)
            while not worker.transport.inbox.empty():
                worker.step(0.0)
            partial = worker.partial(rnd)
            worker.verdicts.settle(rnd.aggregate)  # the close decided its devices' verdicts
            worker.sent.add((round_no, 1))
            if site == self.compromised and partial.count:
                partial = self._forge(partial, len(self.members[site]))
            payloads.append((site, encode_partial(partial, self.site_keys[site])))
        try:
            record = fold_partials(tree, shares, payloads, round_no)
        except RoundFailed:
            record = None
        for site, cohort in cohorts.items():
            for device in cohort:
                sim.settle(device, round_no, trained[device], self.workers[site])
        return record

    def _forge(self, partial, devices: int):
        """The site's honest sums turned into a boosted reversed step with a huge weight."""
        sums = codec.decode("float32", partial.specs, partial.body, None, 1 << 26)
        weight = partial.total_weight
        forged_weight = 100.0 * weight
        tensors = {n: (-10.0 * a / weight * forged_weight if not n.startswith("extra.") else a).astype(np.float32)
                   for n, a in sums.items()}
        encoded = codec.encode(tensors, "float32")
        steps = partial.weighted_steps / weight if weight else 1.0
        partial.specs, partial.body = encoded.specs, encoded.body
        partial.total_weight, partial.weighted_steps = forged_weight, forged_weight * steps
        partial.count = max(partial.count, devices)
        partial.extras_count = min(partial.extras_count, partial.count)
        self.forged += 1
        assert math.isfinite(partial.total_weight)
        return partial
