"""The coordinator's upgrade notice: this agent speaks no protocol version the coordinator serves.

The notice is signed with the device's key (`edgefl_protocol.protocol`). The agent says so once at
ERROR (someone must install another release here), keeps it in its state for `edge-agent status`,
and keeps its session: the coordinator selects it again as soon as it speaks a served version. A
task that arrives later (the coordinator was upgraded or rolled back) clears it.
"""

from __future__ import annotations

import logging

from edgefl_protocol.protocol import UpgradeNotice

from .state import DeviceState

log = logging.getLogger("edge_agent")
KEY = "upgrade_required"


class UpgradeRequired:
    def __init__(self, state: DeviceState) -> None:
        self.state = state
        self.said = state.data.get(KEY)  # what was said (paho's thread reads and writes it)
        self.pending: str | None = None  # said, not yet in the state (the main thread writes the state)
        self.spoken: int | None = None  # the version of the last task

    def notice(self, notice: UpgradeNotice) -> None:
        """On paho's thread: log it the first time; the main thread keeps it (`keep`)."""
        text = notice.text()
        if self.said == text:  # said once, not at every reconnect
            return
        self.said = self.pending = text
        log.error("upgrade required: %s", text)

    def keep(self) -> None:
        """On the main thread: the notice into the state, for `edge-agent status`."""
        if (text := self.pending) is not None:
            self.pending = None
            self.state.data[KEY] = text
            self.state.save()

    def served(self, version: int) -> None:
        """On the main thread, a task arrived in `version`: the coordinator speaks this agent's protocol."""
        if version != self.spoken:
            self.spoken = version
            log.info("the coordinator speaks protocol version %d to this agent", version)
        self.said = None
        if self.state.data.pop(KEY, None) is not None:
            log.info("the coordinator speaks this agent's protocol again: the upgrade notice no longer applies")
            self.state.save()
