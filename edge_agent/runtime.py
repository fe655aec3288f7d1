"""The running agent's session, in a small file in its state dir, for `edge-agent status`.

The broker lets one connection per user in (`use_username_as_clientid`), so a
status check that signed in as the device would kick the running agent off.
Instead the agent notes here, on every connect and disconnect, its pid and
whether it is connected (since when, or why it was dropped); `status` believes
the file while that pid is an agent, and signs in itself only otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any

from edgefl_protocol.persist import atomic_write

log = logging.getLogger("edge_agent")
SESSION_FILE = "session.json"
_hooked: weakref.WeakSet = weakref.WeakSet()  # clients whose disconnects are recorded already


def record_session(client: Any, state_dir: str | Path) -> None:
    """Call from the session's on_connect (paho's network thread): connected since now. The first call
    also chains the client's on_disconnect to note when and why the session dropped."""
    _write(state_dir, connected=True, reason="")
    if client in _hooked:
        return
    _hooked.add(client)
    previous = client.on_disconnect

    def on_disconnect(c, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001 - paho signature
        _write(state_dir, connected=False, reason=str(reason_code))
        if previous:
            previous(c, userdata, flags, reason_code, properties)

    client.on_disconnect = on_disconnect


def _write(state_dir: str | Path, connected: bool, reason: str) -> None:
    path = Path(state_dir) / SESSION_FILE
    text = json.dumps({"pid": os.getpid(), "connected": connected, "since": time.time(), "reason": reason})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text.encode())
    except OSError as exc:  # status falls back to a live check; the session itself is unaffected
        log.warning("cannot write %s: %s", path, exc)


def running_session(state_dir: str | Path) -> dict[str, Any] | None:
    """What the running agent last recorded, or None when no agent is running (or never wrote it)."""
    try:
        info = json.loads((Path(state_dir) / SESSION_FILE).read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if _is_agent(pid) else None


def _is_agent(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's (the service's DynamicUser)
    try:  # a reused pid is not our agent
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid
    return b"edge_agent" in command or b"edge-agent" in command
