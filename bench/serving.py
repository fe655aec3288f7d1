"""The model at work on the devices (`make serving`): bench/results/serving.json and serving.md.

1. fleet: the demo's emulated fleet (`broker-coordinator simulate --fleet zero2w:2,pi3:2,pi4:4,pi5:2
   --round-timeout 6 --serving served`: real Mosquitto, one agent process per device under its class's
   CPU quota). While it runs, the coordinator's `serving.json` and each device's serving store are
   watched: a release's time is its `published_at`, a device's the mtime of the `current` link it made
   (the link is created by the publish, so its mtime is that moment). `release_to_current_s` is, per
   release, the time until every device serves it or a newer version (a device whose gate kept its
   current version is counted apart). Bytes: what the devices counted they received for serving
   (manifests, chunks, deltas; their state files), less the one full release each fetched to join,
   per release; per device and day at the paced defaults' rounds per day (bench/results/pacing.json)
   and this run's releases per round. The full release's size is re-encoded from the run's
   checkpoint as the coordinator encodes it.
2. latency and swaps on one emulated Pi 4 (bench/serving_device.py).
3. local accuracy and the gate on the headline partition, 3 seeds (bench/serving_local.py).

Each section's result is cached in bench/results/serving_runs/ and reused (`--again SECTION` reruns
it); `--report` rebuilds the JSON and table from the cache.

    python -m bench.serving                 (make serving; about 15 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import provenance  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RUNS = RESULTS / "serving_runs"
DEMO_FLEET = "zero2w:2,pi3:2,pi4:4,pi5:2"
FLEET_ROUNDS = 15
SEEDS = (1, 2, 3)
SWAPS = 1000
SECTIONS = ("fleet", "latency", "swaps", "local")


class Watcher:
    """Polls the coordinator's serving.json and the devices' `current` links while a simulation runs."""

    def __init__(self, run_dir: Path, every: float = 0.05) -> None:
        self.run_dir, self.every = run_dir, every
        self.releases: dict[int, float] = {}  # version -> published_at
        self.current: dict[str, dict[int, float]] = {}  # device -> version -> when it became current
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopping.wait(self.every):
            try:
                published = json.loads((self.run_dir / "coordinator" / "serving.json").read_text())
                self.releases.setdefault(int(published["version"]), float(published["published_at"]))
            except (OSError, ValueError, KeyError):
                pass
            for link in self.run_dir.glob("devices/*/state/serving/current"):
                device = link.parts[-4]
                try:
                    version, made = int(os.readlink(link)), os.lstat(link).st_mtime
                except (OSError, ValueError):
                    continue
                self.current.setdefault(device, {}).setdefault(version, made)


def release_times(releases: dict[int, float], current: dict[str, dict[int, float]],
                  devices: list[str]) -> tuple[list[dict], int]:
    """Per release: seconds until every device serves it or a newer version; releases the run ended
    before every device had them are left out (their count is returned)."""
    rows, unfinished = [], 0
    for version, published in sorted(releases.items()):
        times = []
        for device in devices:
            reached = [t for v, t in current.get(device, {}).items() if v >= version]
            if not reached:
                break
            times.append(min(reached) - published)
        if len(times) < len(devices):
            unfinished += 1
            continue
        rows.append({"version": version, "all_devices_s": round(max(times), 3),
                     "median_device_s": round(statistics.median(times), 3)})
    return rows, unfinished


def fleet(rounds: int = FLEET_ROUNDS, seed: int = 1) -> dict:
    out = Path(tempfile.mkdtemp(prefix="edgefl-serving-fleet-"))
    argv = [sys.executable, "-m", "broker_coordinator", "simulate", "--out", str(out), "--fleet", DEMO_FLEET,
            "--round-timeout", "6", "--rounds", str(rounds), "--seed", str(seed), "--serving", "served"]
    watcher = Watcher(out / "run")
    watcher.start()
    started = time.time()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=3600)
    watcher.stop()
    if done.returncode != 0:
        raise RuntimeError(f"simulate failed: {done.stderr[-2000:]}")
    history = json.loads((out / "history.json").read_text())
    devices = sorted(p.name for p in (out / "run" / "devices").iterdir())
    rows, unfinished = release_times(watcher.releases, watcher.current, devices)
    logs = {d: (out / "run" / "devices" / d / "agent.log").read_text() for d in devices}
    kept = sum(text.count(": serving: kept ") for text in logs.values())
    refused = sum(1 for text in logs.values() for line in text.splitlines()
                  if "serving release" in line and " refused: " in line)
    release_bytes = serving_release_bytes(out / "run" / "coordinator")
    downlink = serving_downlink(out / "run" / "devices", release_bytes)
    trained = [r for r in history["rounds"] if r.get("closed") in ("complete", "deadline")]
    down = sum(r.get("bytes_down") or 0 for r in trained[1:])  # reported with the next round's updates
    return {"command": " ".join(argv[1:]), "rounds": len(trained), "devices": len(devices),
            "releases": len(watcher.releases), "release_rows": rows, "unfinished_releases": unfinished,
            "gate_kept": kept, "releases_refused": refused, "release_bytes": release_bytes, "downlink": downlink,
            "training_bytes_down_per_device_round": round(down / len(devices) / max(len(trained) - 1, 1)),
            "final_accuracy": trained[-1].get("accuracy") if trained else None,
            "seconds": round(time.time() - started, 1)}


def serving_downlink(devices_dir: Path, release_bytes: int) -> dict:
    """What the devices received for serving, from their own counts (state.msgpack, `serving_downlink`):
    bytes by message kind and releases fetched in full or by delta. `steady_bytes_per_release` leaves
    out the one full release each device fetches when it joins."""
    import msgpack
    counts = []
    for state in sorted(devices_dir.glob("*/state/state.msgpack")):
        data = msgpack.unpackb(state.read_bytes(), raw=False, strict_map_key=False)
        counts.append(data.get("serving_downlink") or {"bytes": {}, "releases": {}})
    total = {k: sum(c["bytes"].get(k, 0) for c in counts) for k in ("manifest", "full", "delta")}
    releases = {k: sum(c["releases"].get(k, 0) for c in counts) for k in ("full", "delta")}
    joined = sum(1 for c in counts if c["releases"])
    after_first = sum(releases.values()) - joined
    steady = sum(total.values()) - joined * release_bytes
    return {"devices": len(counts), "bytes": total, "releases": releases,
            "steady_bytes_per_release": round(steady / after_first) if after_first > 0 else None}


def serving_release_bytes(state_dir: Path) -> int:
    """The bytes a device fetches for one serving release: the manifest and its chunks, encoded as the
    coordinator encodes the served average (the checkpoint's), in the run's training-model codec."""
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.storage.store import read_checkpoint
    from edgefl_protocol import downlink, messages
    from edgefl_models.architectures import build_model, fingerprint
    ckpt = read_checkpoint(state_dir / "checkpoint.msgpack")
    settings = RoundSettings()  # simulate's --model-codec default is the settings' default
    manifest, chunks = downlink.release(ckpt.version, ckpt.arch, ckpt.served or ckpt.weights, settings.model_codec,
                                        settings.model_chunk_bytes, fingerprint(build_model(ckpt.arch)))
    return len(messages.encode("model", manifest)) + sum(len(c) for c in chunks)


def cached(section: str, again: set[str], make) -> dict:  # noqa: ANN001 - a callable giving the section
    path = RUNS / f"{section}.json"
    if section not in again and path.exists():
        return json.loads(path.read_text())
    print(f"running {section} ...", flush=True)
    result = {**make(), "measured_at_commit": provenance.commit()}
    RUNS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def summary(sections: dict) -> dict:
    from bench import serving_local
    f, lat, sw = sections["fleet"], sections["latency"], sections["swaps"]
    local = [sections[f"local-{s}"] for s in SEEDS]
    paced = json.loads((RESULTS / "pacing.json").read_text())["paced"]
    per_round = f["releases"] / max(f["rounds"], 1)
    steady = f["downlink"]["steady_bytes_per_release"]  # each device's first, full, release left out
    all_devices = [r["all_devices_s"] for r in f["release_rows"]]
    return {
        "measured_with": provenance.measured_with(provenance.invoked(), {
            "fleet": f"{DEMO_FLEET} (broker-coordinator simulate, {f['rounds']} rounds, every default, "
                     "[serving] publish = served, only_better = true)",
            "latency": f"edge-agent serve, {lat['model']}, one torch thread; {lat['device']}; trainer: "
                       "3 threads at nice 10, batch scheduling, CPUWeight 20 vs serve's 100",
            "swaps": f"{sw['count']} versions published (keep 3) while {sw['readers']} read",
            "local": f"headline partition ({len(SEEDS)} seeds, every default, holdout 0.2, gate_margin 0.02, "
                     f"personalize = {serving_local.PERSONALIZE!r}; 'tune' ({serving_local.TUNE_STEPS} steps, lr "
                     f"{serving_local.TUNE_LR}) scored beside it at the end)",
            "sections_at_commits": {k: v.get("measured_at_commit") for k, v in sections.items()}}),
        "release_to_current_s": {
            "releases": len(all_devices), "median_all_devices": round(statistics.median(all_devices), 2),
            "max_all_devices": round(max(all_devices), 2),
            "median_device": round(statistics.median(r["median_device_s"] for r in f["release_rows"]), 2),
            "unfinished_at_end": f["unfinished_releases"]},
        "serving_bytes_per_device_day": round(steady * per_round * paced["rounds"]),
        "serving_bytes_detail": {"release_bytes": f["release_bytes"], "steady_bytes_per_release": steady,
                                 "fetched": f["downlink"]["releases"], "received": f["downlink"]["bytes"],
                                 "releases_per_round": round(per_round, 3),
                                 "paced_rounds_per_day": paced["rounds"],
                                 "training_bytes_down_per_device_day": f["training_bytes_down_per_device_round"]
                                 * paced["rounds"]},
        "release_vs_served_average": {  # central accuracy points: what the deltas encode minus what devices hold
            "max": max((r["release_gap"]["max"] for r in local), key=abs),
            "mean": round(sum(r["release_gap"]["mean"] for r in local) / len(local), 4)},
        "latency_ms": {"training": lat["training"], "idle": lat["idle"],
                       "trainer_cpu_cores": lat["trainer_cpu_share"]},
        "swaps": {"count": sw["count"], "torn_reads": sw["torn_reads"], "partial_reads": sw["partial_reads"],
                  "reads": sw["reads"], "versions_seen": sw["versions_seen"]},
        "gate": {"decisions": sum(sum(r["decisions"].values()) for r in local),
                 "kept": sum(r["decisions"]["kept"] for r in local),
                 "published_personalized": sum(r["decisions"]["published_personalized"] for r in local),
                 "served_worse_than_margin": sum(r["served_worse_than_margin"] for r in local)},
        "local_accuracy": {"global": [r["global"] for r in local], "personalized": [r["personalized"] for r in local],
                           "served": [r["served"] for r in local], "tuned": [r["tuned"] for r in local],
                           "seeds": list(SEEDS), "central_accuracy": [r["central_accuracy"] for r in local]},
        "prior_strength": {  # fitted by each device on its training data, at the last release
            "median": statistics.median(x for r in local for x in r["per_device"]["strength"]),
            "range": [min(x for r in local for x in r["per_device"]["strength"]),
                      max(x for r in local for x in r["per_device"]["strength"])]},
        "local_test_accuracy": {name: [r["test"][name] for r in local]
                                for name in ("global", "personalized", "tuned", "served")},
    }


def markdown(result: dict) -> str:
    r, lat, la = result["release_to_current_s"], result["latency_ms"], result["local_accuracy"]
    mean = lambda v: sum(v) / len(v) * 100  # noqa: E731
    b = result["serving_bytes_detail"]
    lines = ["# The model at work on the devices", "",
             f"`{result['measured_with'].get('command', 'make serving')}`. Settings: `measured_with` in serving.json.",
             "", "| measure | value |", "|---|---|",
             f"| release to current on every device (median / max over {r['releases']} releases) | "
             f"{r['median_all_devices']:.2f} s / {r['max_all_devices']:.2f} s |",
             f"| release to current, median device | {r['median_device']:.2f} s |",
             f"| serving bytes per device per day (paced defaults) | {result['serving_bytes_per_device_day']:,} "
             f"({b['steady_bytes_per_release']:,} B a release after a device's first, full, one of "
             f"{b['release_bytes']:,} B; {b['releases_per_round']:.2f} releases a round, "
             f"{b['paced_rounds_per_day']} rounds a day; training downlink {b['training_bytes_down_per_device_day']:,}) |",
             f"| serving releases fetched by delta / in full (all devices) | {b['fetched'].get('delta', 0)} / "
             f"{b['fetched'].get('full', 0)} |",
             f"| the release devices hold vs the served average it encodes, central accuracy (largest / mean "
             f"gap over the headline runs' releases) | {100 * result['release_vs_served_average']['max']:+.2f} / "
             f"{100 * result['release_vs_served_average']['mean']:+.3f} points |",
             f"| prediction latency, idle (p50 / p99) | {lat['idle']['p50']:.2f} / {lat['idle']['p99']:.2f} ms |",
             f"| prediction latency, while training (p50 / p99) | {lat['training']['p50']:.2f} / "
             f"{lat['training']['p99']:.2f} ms |",
             f"| swaps under concurrent reads: torn / partial reads | {result['swaps']['torn_reads']} / "
             f"{result['swaps']['partial_reads']} in {result['swaps']['count']:,} swaps, "
             f"{result['swaps']['reads']:,} reads |",
             f"| gate decisions: kept the current / served worse than the margin | {result['gate']['kept']} of "
             f"{result['gate']['decisions']} / {result['gate']['served_worse_than_margin']} |",
             f"| device-local accuracy, global served model (mean of seeds) | {mean(la['global']):.2f}% |",
             f"| device-local accuracy, personalized (the device's label prior) | {mean(la['personalized']):.2f}% "
             f"({mean(la['personalized']) - mean(la['global']):+.2f} points) |",
             f"| device-local accuracy, what the gate served | {mean(la['served']):.2f}% |",
             f"| the label prior's strength, fitted by each device (median, range) | "
             f"{result['prior_strength']['median']:g} ({result['prior_strength']['range'][0]:g}-"
             f"{result['prior_strength']['range'][1]:g}) |",
             f"| device-local accuracy, tuned instead (60 SGD steps) | {mean(la['tuned']):.2f}% |", "",
             "Device-local accuracy is each device's held-out data, the samples its gate judged by; on data no "
             "device holds (the test set weighted by each device's label frequencies):", "",
             "| model | global | personalized | tuned | served |", "|---|---|---|---|---|",
             "| mean of seeds | " + " | ".join(f"{mean(result['local_test_accuracy'][k]):.2f}%"
                                              for k in ("global", "personalized", "tuned", "served")) + " |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--again", default="", help="comma-separated sections to run again: " + ", ".join(SECTIONS))
    parser.add_argument("--report", action="store_true", help="only rebuild serving.json and .md from the cache")
    args = parser.parse_args(argv)
    again = set(filter(None, args.again.split(",")))
    if again - set(SECTIONS):
        parser.error(f"unknown sections {sorted(again - set(SECTIONS))}; choose from {', '.join(SECTIONS)}")
    if "local" in again:
        again |= {f"local-{s}" for s in SEEDS}
    if args.report:
        again = set()
    from bench import inmemory, serving_device, serving_local
    inmemory.set_threads(1)
    sections = {"fleet": cached("fleet", again, fleet),
                "latency": cached("latency", again, serving_device.latency),
                "swaps": cached("swaps", again, lambda: serving_device.swaps(SWAPS))}
    for seed in SEEDS:
        sections[f"local-{seed}"] = cached(f"local-{seed}", again, lambda seed=seed: serving_local.run(seed))
    result = summary(sections)
    provenance.write_result("serving", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
