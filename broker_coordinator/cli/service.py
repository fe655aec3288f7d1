"""`broker-coordinator run`: the production loop, and `status`: the federation at a glance."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections import Counter
from typing import Callable

from broker_coordinator.cli.task_start import begin_task, connect_task, skip_attempts_the_devices_ran
from broker_coordinator.engine.loop import Engine, record_dict
from broker_coordinator.engine.pacing import Pacer, read_pace, request_resume
from broker_coordinator.engine.presence import agent_release, ineligible_because
from edgefl_protocol.protocol import serves
from broker_coordinator.engine.serving import read_published
from broker_coordinator.engine.private_rounds import BudgetSpent
from broker_coordinator.engine.rounds import RoundFailed
from broker_coordinator.engine.transport import MqttTransport
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.reporting.report import describe_scores, format_round
from broker_coordinator.reporting.tracking import RunTracker
from broker_coordinator.settings.config import CoordinatorConfig
from broker_coordinator.storage.statelock import StateLock
from broker_coordinator.storage.store import Store
from edgefl_protocol import signing
from edgefl_models.datasets import load_npz
from edgefl_models.objectives import Objective

log = logging.getLogger("broker_coordinator")
DEVICE_KEYS = "device_keys.toml"  # devices provisioned by hand: device = "hex HMAC key", in the state dir


def run(config: CoordinatorConfig, echo: Callable[[str], None] = print) -> int:
    if not os.environ.get("JOURNAL_STREAM"):  # journald stamps time itself; elsewhere, as the log lines do
        said = echo
        echo = lambda line: said(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")  # noqa: E731
    fed, b = config.federation, config.broker
    objective = Objective.of(fed.task, fed.loss)
    test_set = load_npz(fed.test_data, fed.task) if fed.test_data else None
    metrics = Metrics()
    if config.metrics.port:  # Prometheus' /metrics, and the dashboard's page on the same port
        from broker_coordinator.engine.fleet_view import fleet_snapshot
        metrics.serve(config.metrics.port, config.metrics.bind,
                      lambda: fleet_snapshot(config.storage.state_dir, fed.name, serves(fed.min_protocol),
                                             lambda: _revoked(config)))
    keys = signing.read_key_file(f"{config.storage.state_dir}/{DEVICE_KEYS}")  # a fleet provisioned by hand
    lock = StateLock(config.storage.state_dir).acquire("start the coordinator")
    task = begin_task(config)  # a changed task definition archives the task and starts a new one
    root_set = load_npz(fed.root_data, fed.task) if fed.root_data else None
    sites = None
    if config.sites:  # a federation in sites: the coordinator tasks sites and combines their partials
        from broker_coordinator.access.sites import site_key
        from broker_coordinator.engine.tree import SiteSpec
        sites = {name: SiteSpec(s.workers, site_key(b.password, name)) for name, s in config.sites.items()}
    coordinator = Engine(fed.name, fed.model, test_set, config.rounds, seed=fed.seed,
                       store=Store(config.storage.state_dir, config.storage.keep_checkpoints),
                       metrics=metrics, device_keys=keys, root_set=root_set, objective=objective, sites=sites,
                       serving=config.serving, min_protocol=fed.min_protocol)
    tracker = RunTracker.start(config.tracking, fed.name, {name: getattr(config, name) for name in (
        "federation", "broker", "rounds", "storage", "enrollment", "metrics", "sites")}, metrics)  # no secrets: flatten
    stop = lambda *_: coordinator.stopping.set()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    connect_task(coordinator, task, b)  # a new task's versions go on past the previous task's
    desk = attach_enrollment(config, coordinator)
    skip_attempts_the_devices_ran(coordinator)  # after a restore: rounds the devices ran that this state lost
    echo(f"coordinator for federation {fed.name!r} connected to {b.host}:{b.port}; "
         f"starting at round {coordinator.next_round}")
    pacer = Pacer(config.pacing, config.storage.state_dir, objective.higher_is_better, metrics=metrics)
    metrics.privacy_target.set(config.rounds.privacy.target_epsilon or 0.0)
    p = config.pacing
    log.info("pacing: a round at most every %s, %s ([pacing]; interval = 0 and patience = 0 run rounds back to "
             "back)", p.interval if p.interval_seconds else "0 s (back to back)",
             f"rest after {p.patience} evaluations without an improvement of {p.min_improvement:g}" if p.patience
             else "never rest")
    failed = True  # until the loop ends by itself or by a signal
    try:
        while not coordinator.stopping.is_set() and (fed.rounds == 0 or coordinator.next_round <= fed.rounds):
            pacer.wait(coordinator)  # the interval since the last round, or a federation at rest
            if coordinator.serving is not None:
                coordinator.serving.promote_if_asked(coordinator.transport, objective.metric)
            if coordinator.stopping.is_set():
                break
            try:
                record = coordinator.run_round()
            except BudgetSpent as exc:  # [privacy] target_epsilon: no further round opens
                echo(f"stopped: {exc}")
                break
            except RoundFailed as exc:
                if coordinator.stopping.is_set():
                    break
                log.error("%s; waiting before the next attempt", exc)
                coordinator.stopping.wait(config.rounds.round_timeout)
                continue
            pacer.observe(record, coordinator.presence_samples())
            if tracker:
                tracker.round(record)
            echo(format_round(record_dict(record), fed.rounds))
        failed = False
    finally:
        desk.stop()
        coordinator.close()
        lock.release()
        if tracker:  # the plot of this process's rounds; a crash marks the run FAILED
            tracker.finish(title=f"{config.rounds.algorithm} on federation {fed.name}", failed=failed)
    echo("coordinator stopped" if coordinator.stopping.is_set() else f"finished {fed.rounds} rounds")
    return 0


def attach_enrollment(config: CoordinatorConfig, coordinator: Engine):  # noqa: ANN201 - an EnrollmentDesk
    """The device registry admits updates (unknown and revoked devices are rejected) and the
    enrollment desk redeems tokens on the coordinator's own session."""
    from broker_coordinator.access.enrollment import EnrollmentDesk
    from broker_coordinator.access.registry import Registry
    registry = Registry(config.registry_path)
    coordinator.intake.presence.admission = registry.admission

    by_hand = dict(coordinator.intake.keys)  # keys provisioned by hand in device_keys.toml, if any

    def refresh_keys() -> None:  # signed updates: the enrolled devices' keys (over any by hand), swapped in whole
        coordinator.intake.rekey({**by_hand, **registry.signing_keys(config.federation.name)})
        for name, spec in coordinator.topology.sites.items():  # a site's partial counts at most its devices
            spec.devices = sum(config.sites[name].holds(d.name) for d in registry.devices(config.federation.name)
                               if d.state != "revoked")

    refresh_keys()
    desk = EnrollmentDesk(config, registry, on_enrolled=lambda device: refresh_keys())
    assert isinstance(coordinator.transport, MqttTransport)
    desk.attach(coordinator.transport.session.client)
    return desk


def rollback(config: CoordinatorConfig, to_round: int, echo: Callable[[str], None] = print) -> int:
    """Make round `to_round`'s kept checkpoint the live one (the coordinator must be stopped)."""
    with StateLock(config.storage.state_dir).acquire("roll back"):
        store = Store(config.storage.state_dir, config.storage.keep_checkpoints)
        try:
            before = store.load_checkpoint()
            ckpt = store.rollback(to_round)
        finally:
            store.close()
    echo(f"rolled back from round {before.round if before else '?'} to round {ckpt.round}: model sha256 "
         f"{ckpt.sha256[:12]}, served as version {ckpt.version}; the next 'run' starts at round {ckpt.round + 1}")
    return 0


def _device_epsilon(profile: object) -> float | None:
    """A device's own DP-SGD epsilon from its last status ([privacy] device = "dp-sgd"), if it reports one."""
    try:
        value = json.loads(profile).get("dp_epsilon") if isinstance(profile, str) else None
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _revoked(config: CoordinatorConfig) -> set[str]:
    """The registry's revoked devices (none when no device was ever enrolled here)."""
    from broker_coordinator.access.registry import REVOKED, Registry
    if not config.registry_path.exists():
        return set()
    return {d.name for d in Registry(config.registry_path).devices() if d.state == REVOKED}


def resume(config: CoordinatorConfig, echo: Callable[[str], None] = print) -> int:
    """Wake a resting federation (the running coordinator reads the request within a second)."""
    served = read_published(config.storage.state_dir)
    if served is not None:  # what the devices serve ([serving])
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(served.get("published_at", 0)))
        score = served.get("score")
        echo(f"serving: model version {served['version']} (round {served['round']}, {served.get('weights')}"
             + (f", {served.get('metric')} {score:.4g}" if isinstance(score, (int, float)) else "")
             + f") published {when}")
    pace = read_pace(config.storage.state_dir)
    if pace is None or pace.state != "resting":
        echo(f"federation {config.federation.name!r} is not resting"
             + (f" ({pace.state}: {pace.wakes})" if pace and pace.wakes else "") + "; nothing to resume")
        return 0
    request_resume(config.storage.state_dir)
    echo(f"asked federation {config.federation.name!r} to resume (resting since "
         f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(pace.since))}: {pace.why})")
    return 0


def status(config: CoordinatorConfig, echo: Callable[[str], None] = print) -> int:
    store = Store(config.storage.state_dir)
    try:
        ckpt = store.load_checkpoint()
        rounds = [r for r in store.rounds() if r["closed"] in ("complete", "deadline")]
        devices = store.devices()
    finally:
        store.close()
    fed = config.federation
    objective = Objective.of(fed.task, fed.loss)
    echo(f"federation {fed.name!r}, model {fed.model} ({fed.task}, metric {objective.metric}), "
         f"state in {config.storage.state_dir}")
    if ckpt is None:
        echo("no round finished yet")
    else:
        last = rounds[-1] if rounds else ckpt.record
        echo(f"last round {ckpt.round} (model version {ckpt.version}, sha256 {ckpt.sha256[:12]}): "
             f"{describe_scores(last)}, {last['participants']}/{last['selected']} participants")
    pace = read_pace(config.storage.state_dir)
    if pace is not None and pace.state != "running":  # why the federation is idle, and what wakes it
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pace.since))
        echo(f"{pace.state} since {since}: {pace.why}; {pace.wakes}")
    private = (ckpt.trust.get("privacy") if ckpt else None) or {}
    if private:
        target, after = private.get("target_epsilon"), private.get("next_epsilon")
        echo(f"privacy: epsilon {private.get('epsilon', 0.0):.4g} spent at delta {private.get('delta')}"
             + (f" of target_epsilon {target:g}" if target else "")
             + (f"; budget spent: the next round would reach {after:.4g}, so no further round opens"
                if target and after is not None and after > target else ""))
    # a revoked device's last presence may still say online: its broker login is gone, and its last
    # will (on a topic its ACL no longer grants) never lands
    revoked = _revoked(config)
    online = sum(1 for d in devices if d["online"] and d["device"] not in revoked)
    gone = sum(1 for d in devices if d["device"] in revoked)
    echo(f"devices: {online} online of {len(devices)} seen" + (f" ({gone} of them revoked)" if gone else ""))
    releases = Counter(agent_release(d.get("profile")) for d in devices if d["online"] and d["device"] not in revoked)
    if releases:  # the fleet's agent releases ("unknown": 0.1.0, which does not say)
        echo("agent releases: " + ", ".join(f"{v} x{n}" for v, n in sorted(releases.items())))
    for d in devices:
        seen = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["last_seen"]))
        # by the fold's verdict: a left-out update is accepted but contributed nothing
        unjudged = f", other accepted answers {d['unjudged']}" if d["unjudged"] else ""
        epsilon = _device_epsilon(d.get("profile"))
        state = "revoked" if d["device"] in revoked else "online " if d["online"] else "offline"
        why = (ineligible_because(d.get("profile"), serves(config.federation.min_protocol))
               if d["online"] and d["device"] not in revoked else None)
        echo(f"  {d['device']:<24} {state}  last seen {seen}  "
             f"rounds folded {d['folded']}, clipped {d['clipped']}, left out {d['left_out']}{unjudged}"
             + (f", its own DP-SGD epsilon {epsilon:.4g}" if epsilon is not None else "")
             + (f"; may not train now: {why}" if why else ""))
    return 0
