"""Pacing: rounds start `interval` apart, and a federation whose served model stopped improving
rests until its devices hold more data or the operator resumes it (engine/pacing.py)."""

from __future__ import annotations

import threading

import pytest

from broker_coordinator.engine.pacing import Pacer, read_pace, request_resume
from broker_coordinator.settings.pacing_settings import PacingSettings, seconds
from broker_coordinator.settings.round_settings import RoundRecord
from edgefl_protocol.settings import ConfigError, build_section


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class IdleEngine:
    """What the pacer asks of the engine: a stop flag, idle time (which moves the clock), the samples."""

    def __init__(self, clock: Clock, samples: int = 1000) -> None:
        self.clock, self.samples, self.idled = clock, samples, 0.0
        self.stopping = threading.Event()
        self.on_idle = lambda: None

    def idle(self, seconds_: float) -> None:
        self.clock.now += seconds_
        self.idled += seconds_
        self.on_idle()

    def presence_samples(self) -> int:
        return self.samples


def record(round_no: int, score: float) -> RoundRecord:
    return RoundRecord(round_no, 1, 3, 3, score, 0.1, 0, 1.0, {}, "complete", "a", "b", {}, score=score)


def test_durations_read_as_an_operator_writes_them():
    assert [seconds(v, "interval") for v in ("90s", "10m", "2h", "1d", "0", 45, 0.5)] == \
        [90, 600, 7200, 86400, 0, 45, 0.5]
    for bad in ("ten minutes", "-5m", "40d", True):
        with pytest.raises(ValueError, match="interval"):
            seconds(bad, "interval")
    with pytest.raises(ConfigError, match=r"\[pacing\].*interval"):
        build_section(PacingSettings, {"interval": "soon"}, "coordinator.toml [pacing]")


def test_rounds_start_an_interval_apart_and_a_slow_round_does_not_delay_the_next(tmp_path):
    clock = Clock()
    pacer, engine = Pacer(PacingSettings(interval="10m", patience=0), tmp_path, clock=clock), IdleEngine(clock)
    pacer.wait(engine)
    assert engine.idled == 0  # the first round opens at once
    clock.now += 60  # the round took a minute
    pacer.wait(engine)
    assert engine.idled == pytest.approx(540)
    clock.now += 900  # a round slower than the interval
    before = engine.idled
    pacer.wait(engine)
    assert engine.idled == before


def test_a_converged_federation_rests_says_why_and_wakes_on_new_data(tmp_path):
    clock = Clock()
    settings = PacingSettings(interval=0, patience=3, min_improvement=0.01, new_data=0.5)
    pacer, engine = Pacer(settings, tmp_path, clock=clock), IdleEngine(clock, samples=1000)
    for n, score in enumerate([0.50, 0.80, 0.805, 0.79, 0.809], start=1):  # best 0.80 at round 2, then 3 flat
        pacer.wait(engine)
        pacer.observe(record(n, score), engine.presence_samples())
    pace = read_pace(tmp_path)
    assert pace.state == "resting" and "0.01 in 3 evaluations (best 0.8 at round 2)" in pace.why
    assert "1500 samples (1000 now, 50% more)" in pace.wakes and "broker-coordinator resume" in pace.wakes
    # a restarted coordinator keeps resting
    again = Pacer(settings, tmp_path, clock=clock)

    def more_data() -> None:
        if engine.idled >= 30:
            engine.samples = 1500
    engine.on_idle = more_data
    again.wait(engine)
    assert engine.idled == pytest.approx(30) and read_pace(tmp_path).state == "running"


def test_the_operator_resumes_a_resting_federation(tmp_path):
    clock = Clock()
    settings = PacingSettings(interval=0, patience=1, new_data=0)
    pacer, engine = Pacer(settings, tmp_path, clock=clock), IdleEngine(clock)
    pacer.observe(record(1, 0.9), 1000)
    pacer.observe(record(2, 0.9), 1000)
    assert read_pace(tmp_path).state == "resting" and read_pace(tmp_path).wakes == \
        "it resumes on `broker-coordinator resume`"
    engine.on_idle = lambda: request_resume(tmp_path) if engine.idled >= 5 else None
    pacer.wait(engine)
    assert engine.idled == pytest.approx(5) and not (tmp_path / "resume.request").exists()
    pacer.observe(record(3, 0.9), 1000)  # after a resume the old best is no yardstick: no rest at once
    assert read_pace(tmp_path).state == "running"


def test_an_error_metric_improves_downwards_and_rounds_without_a_score_do_not_count(tmp_path):
    clock = Clock()
    pacer = Pacer(PacingSettings(patience=2, min_improvement=0.0), tmp_path, higher_is_better=False, clock=clock)
    for n, score in enumerate([0.5, 0.4, float("nan"), 0.3, 0.2], start=1):
        pacer.observe(record(n, score), 10)
    assert read_pace(tmp_path).state == "running"
    pacer.observe(record(6, 0.25), 10)
    pacer.observe(record(7, 0.2), 10)
    assert read_pace(tmp_path).state == "resting"


def test_a_shutdown_ends_the_wait(tmp_path):
    clock = Clock()
    pacer, engine = Pacer(PacingSettings(interval="1h"), tmp_path, clock=clock), IdleEngine(clock)
    pacer.wait(engine)
    engine.on_idle = lambda: engine.stopping.set() if engine.idled >= 3 else None
    pacer.wait(engine)
    assert engine.idled == pytest.approx(3)


def test_the_new_data_a_resting_federation_waits_for_is_counted_flat_and_in_sites():
    """Devices report their samples in their presence; a site's leader adds up its devices' and
    reports the sum in the site's status, so `new_data` wakes a federation in sites too."""
    from broker_coordinator.engine.presence import DevicePresence, SitePresence
    from broker_coordinator.reporting.metrics import Metrics
    from edgefl_protocol import messages

    def status(who: str, **profile) -> bytes:
        return messages.encode("status", messages.Status(who, "online", profile))

    site_devices = DevicePresence(None, Metrics())  # what a site worker sees of its devices
    site_devices.on_status("pi-1", status("pi-1", samples=120))
    site_devices.on_status("pi-2", status("pi-2", samples=30))
    site_devices.on_status("pi-3", status("pi-3"))  # an agent that has not trained yet reports no samples
    centre = SitePresence()
    centre.on_status("north", status("north", online=3, eligible=3, samples=site_devices.samples()))
    centre.on_status("south", status("south", online=1, eligible=1, samples=50))
    assert site_devices.samples() == 150 and centre.samples() == 200
