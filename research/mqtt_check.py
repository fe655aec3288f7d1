"""Show once that the in-process federation (bench/fedsim.py) matches a run over
MQTT (`broker-coordinator simulate`: private Mosquitto, one agent process per
device) up to noise. Same dataset, partition, seed, algorithm and settings;
the in-process run mirrors the agents' local shuffling seeds. The match runs
ship float32 both ways (the in-process federation has no codec); one more run
over MQTT with the default lossy codec shows what the codec changes.

    python -m research.mqtt_check   # writes bench/results/algorithms_mqtt_check.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_models import datasets, partition

from bench import fedsim, provenance
from bench.algorithm_jobs import RESULTS

AGENTS, ROUNDS, PER_ROUND, PARTITION, SEED = 10, 10, 5, "dirichlet:0.3", 0
CASES = [("dynsam", 0.9, {}), ("fedsmoo", 0.9, {"sam_every": 4})]
EXACT_CODEC = "float32"


def over_mqtt(algorithm: str, momentum: float, hparams: dict, out: Path, codec: str | None) -> list[float]:
    args = [sys.executable, "-m", "broker_coordinator", "simulate", "--agents", str(AGENTS), "--rounds", str(ROUNDS),
            "--dataset", "mnist5k", "--partition", PARTITION, "--clients-per-round", str(PER_ROUND),
            "--algorithm", algorithm, "--momentum", str(momentum), "--seed", str(SEED), "--out", str(out)]
    for key, value in hparams.items():
        args += ["--hparam", f"{key}={value}"]
    if codec:
        args += ["--codec", codec, "--model-codec", codec]
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=1800)
    return [r["accuracy"] for r in json.loads((out / "history.json").read_text())["rounds"]]


def in_process(algorithm: str, momentum: float, hparams: dict) -> list[float]:
    data = datasets.load_mnist5k()
    parts = partition.split(PARTITION, data.train.y, AGENTS, SEED)
    fed = fedsim.Federation("check", data.model, [data.train.subset(p) for p in parts], data.test, ROUNDS, PER_ROUND)
    settings = RoundSettings(algorithm=algorithm, clients_per_round=PER_ROUND, momentum=momentum, hparams=hparams)
    return fedsim.run(fed, settings, SEED, mirror_agent_seed=True).accuracy


def main() -> int:
    fedsim.set_threads(1)
    report = []
    for algorithm, momentum, hparams in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.time()
            mqtt = over_mqtt(algorithm, momentum, hparams, Path(tmp) / "out", EXACT_CODEC)
            mqtt_seconds = time.time() - started
        with tempfile.TemporaryDirectory() as tmp:
            lossy = over_mqtt(algorithm, momentum, hparams, Path(tmp) / "out", None)
        started = time.time()
        local = in_process(algorithm, momentum, hparams)
        gap = max(abs(a - b) for a, b in zip(mqtt, local))
        report.append({"algorithm": algorithm, "momentum": momentum, "hparams": hparams, "mqtt_accuracy": mqtt,
                       "in_process_accuracy": local, "max_abs_difference": gap,
                       "mqtt_default_codec_accuracy": lossy,
                       "mqtt_seconds": mqtt_seconds, "in_process_seconds": time.time() - started})
        print(f"{algorithm}: final {100 * mqtt[-1]:.2f}% over MQTT, {100 * local[-1]:.2f}% in process, "
              f"largest per-round gap {100 * gap:.2f} points; {100 * lossy[-1]:.2f}% over MQTT with the default codec",
              flush=True)
    meta = {"agents": AGENTS, "rounds": ROUNDS, "clients_per_round": PER_ROUND, "partition": PARTITION, "seed": SEED,
            "dataset": "mnist5k", "codec": EXACT_CODEC}
    measured = provenance.measured_with(
        provenance.invoked(), {k: v for k, v in provenance.deciding(RoundSettings()).items()
                               if k not in ("algorithm", "momentum", "codec")},
        varies={"algorithm": [c[0] for c in CASES], "momentum": sorted({c[1] for c in CASES}),
                "codec": [EXACT_CODEC, RoundSettings().codec]},
        data="mnist5k", partition=PARTITION, seeds=[SEED],
        note="simulate against the in-process bench/fedsim.py (whose fold is its own)")
    (RESULTS / "algorithms_mqtt_check.json").write_text(
        json.dumps({"meta": meta, "cases": report, "measured_with": measured}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
