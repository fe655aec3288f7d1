"""Device conditions (edge_agent/conditions.py): the owner's hours, load and temperature thresholds and
daily CPU-seconds, driven by fake clocks and sensors; what the agent publishes of them; how the
coordinator's presence and `devices list` read them; the unit's scheduling priorities."""

from __future__ import annotations

import logging
import re
import math
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from broker_coordinator.access.devices import DeviceRow, stored_profiles
from broker_coordinator.access.registry import Activity, Device, Registry
from broker_coordinator.cli.operator_cli import not_eligible
from broker_coordinator.engine.presence import DevicePresence, ineligible_because
from broker_coordinator.reporting.metrics import Metrics
from broker_coordinator.storage.store import Store
from edge_agent.conditions import Conditions, Hours, read_temperature
from edge_agent.config import ConditionsSettings, load_config
from edge_agent.service import conditions_lines
from edge_agent.training_budget import BUDGET_FILE
from edgefl_protocol import messages
from edgefl_protocol.settings import ConfigError

from .test_systemd import SYSTEMD, directives

DAY = datetime(2026, 3, 14)


def at(hour: int, minute: int = 0, day: datetime = DAY) -> datetime:
    return day.replace(hour=hour, minute=minute)


class Clock:
    """A clock the test moves, and a process CPU time the test spends."""

    def __init__(self, now: datetime) -> None:
        self.now, self.cpu = now, 0.0

    def __call__(self) -> datetime:
        return self.now

    def train(self, conditions: Conditions, seconds: float, cpu: float) -> None:
        with conditions.training():
            self.now += timedelta(seconds=seconds)
            self.cpu += cpu


def conditions(tmp_path: Path, clock: Clock | None = None, load: float | None = 0.0,
               temperature: float | None = None, cores: int = 4, **settings: object) -> Conditions:
    clock = clock or Clock(at(12))
    return Conditions(ConditionsSettings(**settings), tmp_path / "state", clock=clock, load=lambda: load,
                      temperature=lambda: temperature, cpu_time=lambda: clock.cpu, cores=cores)


# hours ------------------------------------------------------------------------------------------
def test_hours_across_midnight():
    night = Hours("22:00-06:00")
    assert [at(h, m) in night for h, m in [(22, 0), (23, 59), (0, 0), (5, 59)]] == [True] * 4
    assert [at(h, m) in night for h, m in [(6, 0), (12, 0), (21, 59)]] == [False] * 3


def test_several_hour_ranges_and_the_end_of_the_day():
    hours = Hours("12:00-13:30,  22:00-24:00")
    assert str(hours) == "12:00-13:30, 22:00-24:00"
    assert [at(h, m) in hours for h, m in [(12, 0), (13, 29), (22, 0), (23, 59)]] == [True] * 4
    assert [at(h, m) in hours for h, m in [(11, 59), (13, 30), (0, 0), (21, 59)]] == [False] * 4


def test_outside_the_hours_is_the_reason(tmp_path):
    clock = Clock(at(12))
    c = conditions(tmp_path, clock, hours="22:00-06:00")
    reason = c.check()
    assert reason is not None and (reason.condition, str(reason)) == ("hours", "outside training hours (22:00-06:00)")
    assert c.check(at(23, 15)) is None and c.check(at(3)) is None


@pytest.mark.parametrize("bad", ["22-06", "25:00-06:00", "22:00-06:60", "08:00-08:00", "00:00-24:00", "22:00"])
def test_bad_hours_stop_the_agent_naming_the_key(tmp_path, bad):
    path = tmp_path / "agent.toml"
    path.write_text(f'[broker]\nhost = "h"\nport = 1883\nusername = "pi"\npassword = "p"\n'
                    f'[device]\nid = "pi"\nstate_dir = "{tmp_path}"\ndata = "d.npz"\n'
                    f'[conditions]\nhours = "{bad}"\n')
    with pytest.raises(ConfigError, match=r"\[conditions\]: hours"):
        load_config(path)


@pytest.mark.parametrize("key, value, says", [("max_load", -1, "max_load must be 0 (off) or positive"),
                                               ("daily_cpu_seconds", -5, "daily_cpu_seconds must be"),
                                               ("max_temperature", 70000, "degrees Celsius")])
def test_bad_thresholds_name_the_key(tmp_path, key, value, says):
    path = tmp_path / "agent.toml"
    path.write_text(f'[broker]\nhost = "h"\nport = 1883\nusername = "pi"\npassword = "p"\n'
                    f'[device]\nid = "pi"\nstate_dir = "{tmp_path}"\ndata = "d.npz"\n[conditions]\n{key} = {value}\n')
    with pytest.raises(ConfigError, match=rf"\[conditions\]: .*{re.escape(says)}"):
        load_config(path)


def test_no_conditions_by_default(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(f'[broker]\nhost = "h"\nport = 1883\nusername = "pi"\npassword = "p"\n'
                    f'[device]\nid = "pi"\nstate_dir = "{tmp_path}"\ndata = "d.npz"\n')
    config = load_config(path)
    c = Conditions(config.conditions, tmp_path, load=lambda: 99.0, temperature=lambda: 99.0)
    assert not c.enabled and c.check() is None
    assert conditions_lines(config) == ["conditions: none (it may train whenever the coordinator asks)",
                                        "may train:  yes"]


# load -------------------------------------------------------------------------------------------
def test_load_per_core_above_the_threshold(tmp_path):
    c = conditions(tmp_path, load=6.0, cores=4, max_load=1.0)
    reason = c.check()
    assert reason is not None and reason.condition == "load" and "1.50 per core" in str(reason)
    assert conditions(tmp_path, load=3.9, cores=4, max_load=1.0).check() is None


def test_the_agents_own_training_is_left_out_of_the_load(tmp_path):
    """Two threads' worth of training for a minute leaves 2 (1 - 1/e) = 1.26 in the 1-minute load average
    as it ends, e^-1 of that a minute later; the device's other work is what is judged."""
    clock = Clock(at(12))
    load = [0.0]
    c = Conditions(ConditionsSettings(max_load=0.5), tmp_path, clock=clock, load=lambda: load[0],
                   temperature=lambda: None, cpu_time=lambda: clock.cpu, cores=2)
    clock.train(c, seconds=60, cpu=120)
    own = 2 * (1 - math.exp(-1))
    load[0] = own + 0.8  # others: 0.4 per core
    assert c.others_load(clock.now) == pytest.approx(0.4) and c.check() is None
    load[0] = own + 1.2  # others: 0.6 per core
    assert c.check().condition == "load"
    clock.now += timedelta(seconds=60)
    load[0] = own / math.e + 0.8
    assert c.others_load(clock.now) == pytest.approx(0.4)
    restarted = Conditions(ConditionsSettings(max_load=0.5), tmp_path, clock=clock, load=lambda: load[0], cores=2)
    assert restarted.others_load(clock.now) == pytest.approx(0.4)  # the trainings are in the state dir


# temperature -------------------------------------------------------------------------------------
def test_temperature_from_a_fake_sysfs(tmp_path):
    for zone, text in [("thermal_zone0", "45000\n"), ("thermal_zone1", "81250\n"), ("thermal_zone2", "")]:
        (tmp_path / zone).mkdir()
        (tmp_path / zone / "temp").write_text(text)
    (tmp_path / "cooling_device0").mkdir()
    assert read_temperature(tmp_path) == 81.25
    c = Conditions(ConditionsSettings(max_temperature=75), tmp_path / "state", thermal=tmp_path)
    reason = c.check()
    assert reason is not None and reason.condition == "temperature" and "81.2 °C" in str(reason)
    (tmp_path / "thermal_zone1" / "temp").write_text("70000\n")
    assert c.check() is None


def test_no_sensor_is_no_limit_said_once(tmp_path, caplog):
    c = Conditions(ConditionsSettings(max_temperature=60), tmp_path / "state", thermal=tmp_path / "none")
    with caplog.at_level(logging.INFO, logger="edge_agent"):
        assert c.check() is None and c.check() is None
    said = [r for r in caplog.records if "no temperature sensor" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


# CPU-seconds a day ----------------------------------------------------------------------------
def test_daily_cpu_seconds_persist_across_a_restart_and_roll_over_at_midnight(tmp_path):
    clock = Clock(at(23, 40))
    c = conditions(tmp_path, clock, daily_cpu_seconds=100)
    clock.train(c, seconds=60, cpu=70)
    assert c.check() is None  # 70 of 100
    clock.train(c, seconds=60, cpu=45)  # started under the cap: finished, and counted
    reason = c.check()
    assert reason is not None and reason.condition == "cpu_seconds" and "trained 115 CPU-seconds today" in str(reason)

    restarted = conditions(tmp_path, clock, daily_cpu_seconds=100)
    assert restarted.check().condition == "cpu_seconds"
    assert (tmp_path / "state" / BUDGET_FILE).exists()

    clock.now = at(0, 0, DAY + timedelta(days=1))  # local midnight: a new day's budget
    assert restarted.check() is None
    clock.train(restarted, seconds=30, cpu=30)
    assert restarted.budget.spent(clock.now.date()) == 30 and restarted.check() is None


def test_a_training_stopped_midway_still_counts(tmp_path):
    clock = Clock(at(9))
    c = conditions(tmp_path, clock, daily_cpu_seconds=10)
    with pytest.raises(KeyboardInterrupt):
        with c.training():
            clock.cpu += 12
            raise KeyboardInterrupt
    assert c.check().condition == "cpu_seconds"


def test_an_unreadable_budget_counts_from_zero(tmp_path, caplog):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / BUDGET_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="edge_agent"):
        c = conditions(tmp_path, daily_cpu_seconds=10)
    assert c.check() is None and "counts from 0" not in caplog.text and "count from 0" in caplog.text


def test_the_first_condition_not_met_is_the_reason_and_describe_says_all(tmp_path):
    clock = Clock(at(23))
    c = conditions(tmp_path, clock, load=8.0, temperature=90.0, hours="22:00-06:00", max_load=1.0,
                   max_temperature=80, daily_cpu_seconds=3600)
    assert c.check().condition == "temperature"
    assert c.describe() == ("hours 22:00-06:00, load at most 1 per core, temperature at most 80 °C, "
                            "3600 CPU-seconds a day (0 used today)")


# the coordinator's side -------------------------------------------------------------------------
def status(device: str, **profile: object) -> bytes:
    return messages.encode("status", messages.Status(device, "online", {"busy": False, **profile}))


def test_presence_does_not_select_a_device_that_says_it_may_not_train(tmp_path):
    store = Store(tmp_path)
    presence = DevicePresence(store, Metrics())
    presence.on_status("old", status("old"))  # an agent of the previous release says nothing: eligible
    presence.on_status("ok", status("ok", eligible=True))
    presence.on_status("night", status("night", eligible=False, why="outside training hours (22:00-06:00)"))
    assert sorted(presence.eligible()) == ["ok", "old"] and presence.population() == 3
    assert presence.not_eligible() == {"night": "outside training hours (22:00-06:00)"}
    presence.on_status("night", status("night", eligible=True))  # its hours began
    assert sorted(presence.eligible()) == ["night", "ok", "old"]
    presence.on_status("night", status("night", eligible=False, why="CPU load 1.20 per core besides its own "
                                                                     "training, above max_load 1"))
    profiles = {d["device"]: d["profile"] for d in store.devices()}  # what `status` and `devices list` read
    assert '"why": "CPU load 1.20 per core' in profiles["night"] and '"eligible": false' in profiles["night"]
    assert ineligible_because({"eligible": False}) == "its own conditions (it gave no reason)"
    assert ineligible_because(profiles["night"]).startswith("CPU load 1.20")  # the stored JSON text, as `status` has it
    assert [ineligible_because(p) for p in (None, "not json", '{"eligible": true}', "[]")] == [None] * 4
    store.close()


def test_devices_list_names_the_devices_that_may_not_train(tmp_path):
    store = Store(tmp_path)
    store.record_presence("pi-08", True, {"eligible": False, "why": "outside training hours (22:00-06:00)"})
    store.record_presence("pi-07", True, {"eligible": True})
    store.close()
    stored = stored_profiles(Registry(tmp_path / "coordinator.db"))
    assert stored["pi-08"]["why"] == "outside training hours (22:00-06:00)"

    def row(name: str, online: str) -> DeviceRow:
        device = Device(name=name, federation="f", state="active", password_hash="", signing_key="", token_id="",
                        token_expires=0.0, created_at=0.0, enrolled_at=None, revoked_at=None)
        return DeviceRow(device, online, Activity(), stored.get(name, {}))

    assert not_eligible([row("pi-07", "online"), row("pi-08", "online")]) == [
        ("pi-08", "outside training hours (22:00-06:00)")]
    assert not_eligible([row("pi-08", "offline")]) == []  # offline: not selected anyway, for another reason


# the agent's unit --------------------------------------------------------------------------------
def test_the_agent_unit_puts_the_owners_applications_first():
    d = directives((SYSTEMD / "edge-agent.service").read_text())
    assert int(d["Nice"][0]) >= 10 and d["CPUSchedulingPolicy"] == ["batch"] and d["IOSchedulingClass"] == ["idle"]
    assert int(d["CPUWeight"][0]) < 100 and int(d["IOWeight"][0]) < 100  # below the default share of 100
    assert int(d["OOMScoreAdjust"][0]) > 0


# the agent ---------------------------------------------------------------------------------------
def test_the_agent_says_when_it_may_not_train_republishes_on_change_only_and_refuses_tasks(tmp_path):
    import time

    import numpy as np

    from edge_agent.agent import Agent
    from edgefl_protocol import signing
    from edgefl_models import datasets

    data = datasets.load("digits")
    datasets.save_npz(tmp_path / "data.npz", data.train.subset(np.arange(50)))
    key = signing.new_key()
    (tmp_path / "agent.toml").write_text(
        f'[broker]\nhost = "127.0.0.1"\nport = 1\nusername = "pi"\npassword = "p"\n'
        f'[device]\nid = "pi"\ndata = "{tmp_path / "data.npz"}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'signing_key = "{key.hex()}"\n[conditions]\nhours = "22:00-06:00"\nmax_load = 1.0\n')
    agent = Agent(load_config(tmp_path / "agent.toml"))
    clock, load = Clock(at(12)), [0.0]
    agent.conditions = Conditions(agent.config.conditions, tmp_path / "state", clock=clock, load=lambda: load[0],
                                  cores=1)
    published: list[bytes] = []
    agent.session.publish = lambda topic, payload, retain=False: published.append(payload)  # type: ignore[method-assign]
    sent: list[bytes] = []
    agent.delivery.deliver = lambda task, payload, what: sent.append(payload)  # type: ignore[method-assign]

    def tick() -> None:
        agent._next_check = 0.0
        agent._idle_tick()

    def last_profile() -> dict:
        return messages.decode_status(published[-1]).profile

    clock.now, agent.not_eligible = at(22, 30), None  # in its hours, as it last said
    tick()
    assert published == []  # nothing changed: nothing published
    clock.now = at(12)
    tick()
    assert last_profile()["eligible"] is False and last_profile()["why"] == "outside training hours (22:00-06:00)"
    tick()
    assert len(published) == 1
    clock.now = at(22, 30)
    tick()
    assert len(published) == 2 and last_profile()["eligible"] is True and "why" not in last_profile()
    load[0] = 1.5
    tick()
    load[0] = 1.7  # the reading moves, the condition does not: not published again
    tick()
    assert len(published) == 3 and "CPU load 1.50" in last_profile()["why"]

    task = messages.Task(round=4, model_version=3, deadline=time.time() + 60, algorithm="fedavg")
    agent._work_on(task)  # a task that arrives anyway is refused, signed, with the reason
    refusal = messages.decode_answer(sent[-1], 65536, key, "pi")
    assert isinstance(refusal, messages.Refusal) and refusal.reason == "ineligible"
    assert refusal.round == 4 and "CPU load 1.70" in refusal.detail
