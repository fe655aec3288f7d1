"""What release each agent runs: its presence says so, and the coordinator counts the fleet's
releases for the operator (`status`, `devices list`, Prometheus' `edgefl_agents{version}`)."""

from __future__ import annotations

from broker_coordinator.engine.presence import DevicePresence, agent_release
from broker_coordinator.reporting.metrics import Metrics
from edgefl_protocol import SCHEMA_VERSION, messages
from edgefl_protocol.version import PROTOCOLS, release, software


def status(device: str, **profile) -> bytes:
    return messages.encode("status", messages.Status(device, "online", profile))


def test_an_agent_reports_its_release_and_protocols_as_a_status_profile_holds_them():
    mine = software()
    assert mine["agent"] == release() and mine["protocols"] == "1,2" and PROTOCOLS == (1, SCHEMA_VERSION)
    assert all(isinstance(v, str) and v for v in mine.values())
    decoded = messages.decode_status(status("pi-01", **mine))  # what the coordinator reads back
    assert decoded.profile["agent"] == release()


def test_the_coordinator_counts_online_agents_by_release_and_an_old_agent_is_unknown():
    metrics = Metrics()
    presence = DevicePresence(None, metrics)
    presence.on_status("pi-01", status("pi-01", agent="0.2.0"))
    presence.on_status("pi-02", status("pi-02", agent="0.2.0"))
    presence.on_status("pi-03", status("pi-03"))  # an agent of 0.1.0 says nothing of its release
    series = lambda v: metrics.agents.labels(v)._value.get()  # noqa: E731
    assert (series("0.2.0"), series("unknown")) == (2, 1)
    presence.on_status("pi-03", b"")  # its status cleared: the unknown series goes to 0, not away
    assert (series("0.2.0"), series("unknown")) == (2, 0)
    assert agent_release('{"agent": "0.2.0"}') == "0.2.0" and agent_release(None) == "unknown"
