"""What pacing saves a fleet in a day: rounds back to back against the paced defaults, in one run.

The demo's fleet mix (Pi Zero 2 W, Pi 3, Pi 4, Pi 5; `make demo`), each device on its share of
scikit-learn's digits, trains through the engine's in-memory transport with the agent's own device
step (`bench/inmemory.py`) over a simulated day. Time is simulated: a round lasts as long as its
slowest device trains at its class's speed (plus `OVERHEAD` seconds for the transfers), and the
coordinator's pacer (`broker_coordinator/engine/pacing.py`, the code `broker-coordinator run`
runs) waits on that clock. Which devices may train comes from their owners' conditions
(`edge_agent/conditions.py`): the last `NIGHT_OWLS` devices train only at night ("22:00-06:00"),
published in their presence as agents do, and the cohort is what the engine's own presence
(`DevicePresence.eligible`) offers.

- back_to_back: `[pacing] interval = 0, patience = 0`, as 0.1.0 ran. A day of it is thousands of
  rounds; `--measured-rounds` of them run, and the day is extrapolated from their mean length and
  CPU (the JSON says so).
- paced: the defaults (`PacingSettings()`), run for the whole simulated day.

A device's training CPU-seconds are its samples x epochs over its speed (the host's pinned
throughput x its class's speed, as `bench/inmemory.py` emulates it). `ineligible_training_seconds`
adds up the training of any device at a moment its conditions said it may not train.

    python -m bench.pacing            (make pacing; about 5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from broker_coordinator.engine.pacing import Pacer
from broker_coordinator.engine.rounds import RoundFailed
from broker_coordinator.settings.pacing_settings import PacingSettings
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.fleet import PROFILES
from broker_coordinator.simulation.in_memory import fold_round
from edge_agent.conditions import Hours
from edgefl_models import datasets, partition

from . import provenance
from .inmemory import InMemoryFederation, host_speed, set_threads

RESULTS = Path(__file__).parent / "results"
FLEET = ["zero2w"] * 2 + ["pi3"] * 2 + ["pi4"] * 4 + ["pi5"] * 2  # the demo's mix (Makefile DEMO_FLEET)
NIGHT_OWLS = 2  # devices whose owners let them train only at night
NIGHT = "22:00-06:00"
OVERHEAD = 1.0  # seconds a round spends on transfers and the fold beyond its slowest device's training
DAY = 86400.0
ARCH = "digits_mlp"


class SimulatedDay:
    """The engine as the pacer sees it, on a simulated clock: idling moves the clock, and the day's
    end stops the loop. Each idle second the devices' presence follows their conditions."""

    def __init__(self, fed: InMemoryFederation, start: datetime, conditions: dict[str, Hours]) -> None:
        self.fed, self.start, self.conditions = fed, start, conditions
        self.now = 0.0  # seconds since the day began
        self.stopping = threading.Event()
        self.present()

    def clock(self) -> float:
        return self.start.timestamp() + self.now

    def moment(self) -> datetime:
        return self.start + timedelta(seconds=self.now)

    def may_train(self, device: str) -> bool:
        hours = self.conditions.get(device)
        return hours is None or self.moment() in hours

    def present(self) -> None:
        """Every device online, saying whether it may train (as agents do in their retained status)."""
        presence = self.fed.coordinator.presence
        for device in self.fed.devices:
            may = self.may_train(device)
            presence.online[device] = {"samples": len(self.fed.data[device]), "eligible": may,
                                       **({} if may else {"why": f"outside training hours ({NIGHT})"})}

    def advance(self, seconds: float) -> None:
        self.now += seconds
        if self.now >= DAY:
            self.stopping.set()
        self.present()

    def idle(self, seconds: float) -> None:
        self.advance(seconds)

    def presence_samples(self) -> int:
        return self.fed.coordinator.presence_samples()


def run_day(label: str, pacing: PacingSettings, max_rounds: int | None, seed: int) -> tuple[dict[str, Any], float]:
    data = datasets.load("digits")
    parts = partition.split("iid", data.train.y, len(FLEET), seed)
    settings = RoundSettings(clients_per_round=0)
    fed = InMemoryFederation(ARCH, [data.train.subset(p) for p in parts], data.test, settings, seed=seed,
                             clients_per_round=0, fleet=FLEET)
    conditions = {device: Hours(NIGHT) for device in fed.devices[-NIGHT_OWLS:]}
    day = SimulatedDay(fed, datetime(2026, 12, 7, 0, 0), conditions)
    pacer = Pacer(pacing, None, clock=day.clock)
    cpu = {device: 0.0 for device in fed.devices}
    ineligible = 0.0
    rounds, lengths, accuracy = 0, [], float("nan")
    while not day.stopping.is_set() and (max_rounds is None or rounds < max_rounds):
        pacer.wait(day)
        if day.stopping.is_set():
            break
        rounds += 1
        cohort = sorted(fed.coordinator.presence.eligible())  # the engine's presence decides who trains
        hp = settings.task_hparams(rounds)
        trained = {device: fed.train(device, rounds, hp) for device in cohort}
        seconds = {}
        for device, step in trained.items():
            samples = step.result.metrics.get("epochs", 1) * step.result.num_samples
            seconds[device] = samples / (host_speed(ARCH) * PROFILES[fed.classes[device]].speed)
            cpu[device] += seconds[device]
            if not day.may_train(device):
                ineligible += seconds[device]
        try:
            record = fold_round(fed.coordinator, {d: t.payload for d, t in trained.items()}, rounds)
        except RoundFailed:
            record = None
        for device, step in trained.items():
            fed.settle(device, rounds, step)
        length = max(seconds.values(), default=0.0) + OVERHEAD
        lengths.append(length)
        day.advance(length)
        if record is not None:
            accuracy = record.accuracy
            pacer.observe(record, day.presence_samples())
    per_device = statistics.mean(cpu.values())
    result = {"rounds": rounds, "final_accuracy": round(accuracy, 4),
              "cpu_seconds_per_device": round(per_device, 2), "mean_round_seconds": round(statistics.mean(lengths), 2),
              "simulated_seconds": round(min(day.now, DAY), 1), "pacing": asdict(pacing),
              "state_at_end": pacer.pace.state, "why": pacer.pace.why}
    if max_rounds is not None and day.now < DAY:  # a day of back-to-back rounds, from the rounds that ran
        scale = DAY / day.now
        result.update(measured_rounds=rounds, measured_cpu_seconds_per_device=round(per_device, 2),
                      rounds=round(rounds * scale), cpu_seconds_per_device=round(per_device * scale, 1),
                      extrapolated=f"{rounds} rounds ran ({day.now:.0f} simulated seconds); rounds and CPU scaled "
                                   f"to a day by {scale:.1f}, the accuracy is the last measured round's")
    print(f"{label}: {result['rounds']} rounds, {result['cpu_seconds_per_device']} training CPU-s per device, "
          f"accuracy {result['final_accuracy']}", flush=True)
    return result, ineligible


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured-rounds", type=int, default=60,
                        help="back-to-back rounds that run before the day is extrapolated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    set_threads(1)
    started = time.monotonic()
    back, ineligible_back = run_day("back_to_back", PacingSettings(interval=0, patience=0), args.measured_rounds,
                                    args.seed)
    paced, ineligible_paced = run_day("paced", PacingSettings(), None, args.seed)
    out = {"measured_with": provenance.measured_with(
               provenance.invoked(), provenance.deciding(RoundSettings(clients_per_round=0)), data="digits (sklearn)",
               fleet=",".join(f"{c}:{FLEET.count(c)}" for c in dict.fromkeys(FLEET)), model=ARCH,
               night_owls=f"{NIGHT_OWLS} devices train only {NIGHT}", round_overhead_s=OVERHEAD,
               host_samples_per_cpu_s=round(host_speed(ARCH), 1), seed=args.seed,
               wall_seconds=round(time.monotonic() - started)),
           "back_to_back": back, "paced": paced,
           "cpu_ratio": round(back["cpu_seconds_per_device"] / max(paced["cpu_seconds_per_device"], 1e-9), 1),
           "accuracy_points_lost": round(100 * (back["final_accuracy"] - paced["final_accuracy"]), 2),
           "ineligible_training_seconds": round(ineligible_back + ineligible_paced, 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pacing.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.out / "pacing.md").write_text(table(out))
    print(table(out))
    return 0


def table(out: dict[str, Any]) -> str:
    b, p = out["back_to_back"], out["paced"]
    return "\n".join([
        "# Pacing: a simulated day of the demo's fleet", "",
        f"`{out['measured_with']['command']}` at {out['measured_with']['commit']}; "
        f"{out['measured_with']['night_owls']}.", "",
        "| | rounds a day | training CPU-s per device a day | final accuracy |",
        "| --- | ---: | ---: | ---: |",
        f"| back to back | {b['rounds']} | {b['cpu_seconds_per_device']} | {100 * b['final_accuracy']:.2f}% |",
        f"| paced (defaults) | {p['rounds']} | {p['cpu_seconds_per_device']} | {100 * p['final_accuracy']:.2f}% |",
        "",
        f"Paced devices train {out['cpu_ratio']}x fewer CPU-seconds for {out['accuracy_points_lost']} points of "
        f"accuracy; devices trained {out['ineligible_training_seconds']} s outside their conditions.",
        f"Back to back: {b.get('extrapolated', '')}. Paced: {p['state_at_end']} at the end of the day"
        + (f" ({p['why']})" if p["why"] else "") + ".", ""])


if __name__ == "__main__":
    raise SystemExit(main())
