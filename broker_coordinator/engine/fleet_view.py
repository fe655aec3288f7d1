"""What the dashboard shows (/fleet.json, reporting/dashboard.py): the fleet, the rounds and the
pacing, read from the state directory at each request, as `broker-coordinator status` reads them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker_coordinator.engine.pacing import read_pace
from broker_coordinator.engine.presence import agent_release, ineligible_because, parse_profile
from broker_coordinator.storage.store import Store

ROUNDS_SHOWN = 500  # the newest rounds of the current task


def fleet_snapshot(state_dir: Path | str, federation: str, serves: tuple[int, ...],
                   revoked: Callable[[], set[str]] = set) -> dict[str, Any]:
    """Devices, rounds and pacing, as the state directory holds them now."""
    store = Store(state_dir)
    try:
        rows = [r for r in store.rounds() if store.task is None or r.get("task") in (None, store.task)]
        devices = store.devices()
    finally:
        store.close()
    gone = revoked()
    fleet = []
    for d in devices:
        profile = parse_profile(d.get("profile"))
        online = bool(d["online"]) and d["device"] not in gone
        why = ineligible_because(profile, serves) if online else None
        fleet.append({"device": d["device"], "state": "revoked" if d["device"] in gone else
                      "online" if online else "offline", "last_seen": d["last_seen"],
                      "version": agent_release(profile), "machine": profile.get("machine", ""),
                      "cores": profile.get("cores"), "memory_mb": profile.get("memory_mb"),
                      "eligible": online and why is None, "why": why,
                      "rounds": d["rounds"], "folded": d["folded"], "clipped": d["clipped"],
                      "left_out": d["left_out"], "last_verdict": d.get("last_verdict"),
                      "serving": profile.get("serving_current")})
    rounds = [{"round": r["round"], "attempt": r["attempt"], "closed": r["closed"], "metric": r.get("metric"),
               "score": _finite(r.get("score")), "participants": r.get("participants"), "selected": r.get("selected"),
               "bytes_up": r.get("bytes_up"),
               "epsilon": _finite(r.get("epsilon"))} for r in rows[-ROUNDS_SHOWN:]]
    pace = read_pace(state_dir)
    return {"federation": federation, "generated_at": time.time(), "devices": fleet, "rounds": rounds,
            "pacing": None if pace is None else {"state": pace.state, "why": pace.why, "wakes": pace.wakes}}


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value == value and abs(value) != float("inf") else None
