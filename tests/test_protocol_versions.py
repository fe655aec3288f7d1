"""Protocol versions: what each side speaks, the coordinator's choice per device, signed messages to
a device from version 2 on, a newer version refused with its reason, and the upgrade notice."""

from __future__ import annotations

import logging

import msgpack
import pytest

from broker_coordinator.engine.device_wire import DeviceWire
from broker_coordinator.engine.presence import DevicePresence, ineligible_because
from broker_coordinator.reporting.metrics import Metrics
from edge_agent.state import DeviceState
from edge_agent.upgrade import UpgradeRequired
from edgefl_protocol import messages, protocol, signing, topics
from edgefl_protocol.errors import Rejected

KEY = signing.new_key()
TASK = messages.Task(round=3, model_version=2, deadline=1e10, algorithm="fedavg")


def test_each_release_speaks_the_current_and_the_previous_version():
    assert protocol.SPOKEN == (1, 2) and protocol.serves() == (1, 2) and protocol.serves(2) == (2,)
    with pytest.raises(ValueError, match="min_protocol must be one of 1, 2"):
        protocol.serves(3)
    assert protocol.announced({}) == (1,)  # an agent of 0.1.0 announces nothing: it speaks 1
    assert protocol.announced({"protocols": "1,2"}) == (1, 2)
    assert protocol.announced({"protocols": "2, 3,x"}) == (2, 3)
    assert protocol.choose((1, 2), (1, 2)) == 2 and protocol.choose((1,), (1, 2)) == 1
    assert protocol.choose((2, 3), (1, 2)) == 2  # a newer agent speaks its coordinator's version
    assert protocol.choose((1,), (2,)) is None


def test_a_message_of_an_unknown_future_version_is_refused_with_its_reason():
    future = msgpack.unpackb(messages.encode("task", TASK))
    future["schema"] = 3
    with pytest.raises(Rejected) as refused:
        messages.decode_task(msgpack.packb(future))
    assert refused.value.reason == "protocol"
    assert "protocol version 3: this release speaks 1 to 2; the side that sent it is newer" in str(refused.value)


def test_a_task_is_read_in_either_version_and_answered_in_its_own():
    old = messages.decode_task(protocol.unseal(protocol.seal("task", TASK, 1, KEY), KEY))
    new = messages.decode_task(protocol.unseal(protocol.seal("task", TASK, 2, KEY), KEY))
    assert (old.protocol, new.protocol) == (1, 2) and old.round == new.round == 3
    update = messages.Update("pi-01", 3, 2, 10, {}, b"", "float32", [], "orchard")
    for task in (old, new):
        answer = messages.encode_update(update, KEY, task.protocol)
        assert msgpack.unpackb(signing.verify(answer, KEY))["schema"] == task.protocol
        assert messages.decode_answer(answer, 1 << 20, KEY).device == "pi-01"  # the coordinator reads both


def test_from_version_2_what_the_coordinator_sends_a_device_is_signed():
    assert protocol.seal("task", TASK, 1, KEY)[:4] != signing.MAGIC  # 0.1.0 reads plain tasks
    sealed = protocol.seal("task", TASK, 2, KEY)
    assert sealed[:4] == signing.MAGIC
    with pytest.raises(Rejected, match="signature does not match"):
        protocol.unseal(sealed, signing.new_key())
    with pytest.raises(Rejected, match="an unsigned protocol-2 message from the coordinator"):
        protocol.unseal(messages.encode("task", TASK, 2), KEY)  # someone else wrote on its task topic


def test_a_device_that_shares_no_version_is_not_selected_and_told_once_what_to_install(caplog):
    sent: list[tuple[str, bytes]] = []
    presence = DevicePresence(None, Metrics(), serves=(2,))
    wire = DeviceWire("orchard", lambda device: KEY, (2,), lambda topic, payload: sent.append((topic, payload)))
    presence.on_online = wire.heard

    def status(device: str, **profile) -> bytes:
        return messages.encode("status", messages.Status(device, "online", profile), 1)

    with caplog.at_level(logging.INFO, logger="broker_coordinator"):
        presence.on_status("pi-01", status("pi-01", protocols="1,2"))
        presence.on_status("pi-02", status("pi-02", protocols="1"))  # an agent that reads notices, too old
        presence.on_status("pi-02", status("pi-02", protocols="1", busy=False))  # heard again: not told again
        presence.on_status("pi-03", status("pi-03"))  # 0.1.0: announces nothing, reads no notice
    assert presence.eligible() == ["pi-01"]
    assert "install edgefl>=0.2.0 on it" in presence.not_eligible()["pi-02"]
    assert ineligible_because({"protocols": "1,2"}, (2,)) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("is not selected until you install edgefl>=0.2.0" in w for w in warned)
    assert [topic for topic, _ in sent] == [topics.receipt("orchard", "pi-02")]  # one notice, to pi-02 only
    notice = protocol.decode_upgrade(protocol.unseal(sent[0][1], KEY))
    assert (notice.device, notice.speaks, notice.serves, notice.install) == ("pi-02", "1", "2", "edgefl>=0.2.0")
    assert wire.version("pi-01") == 2 and protocol.unseal(wire.seal("pi-01", "task", TASK), KEY)


def test_any_release_reads_the_upgrade_notice_in_any_version():
    notice = protocol.upgrade_notice("pi-07", (5, 6), (7, 8), "0.5.0", KEY)  # a release far ahead of this one
    read = protocol.decode_upgrade(protocol.unseal(notice, KEY))
    assert read.install == "edgefl>=0.5.0" and read.serves == "7,8"
    too_new = protocol.upgrade_notice("pi-07", (3,), (1, 2), "0.2.0", KEY)
    assert "edgefl==0.2.0, the coordinator's release (or upgrade the coordinator)" in \
        protocol.decode_upgrade(protocol.unseal(too_new, KEY)).text()


def test_the_agent_says_an_upgrade_is_required_once_and_status_shows_it(tmp_path, caplog):
    state = DeviceState(tmp_path)
    upgrade = UpgradeRequired(state)
    notice = protocol.UpgradeNotice("pi-02", "1", "2", "edgefl>=0.2.0")
    with caplog.at_level(logging.INFO, logger="edge_agent"):
        for _ in range(3):  # the coordinator's notice again after each reconnect
            upgrade.notice(notice)
            upgrade.keep()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["upgrade required: the coordinator serves protocol version(s) 2 and this agent speaks 1: "
                      "install edgefl>=0.2.0 on this device (docs/OPERATOR.md, 'Upgrading')"]
    assert DeviceState(tmp_path).data["upgrade_required"].startswith("the coordinator serves protocol version(s) 2")
    upgrade.served(2)  # a task came: the coordinator speaks our version again
    assert "upgrade_required" not in DeviceState(tmp_path).data
