"""Local training cost per client-round, measured under equal conditions: one
process, one thread, algorithms interleaved on the same headline clients, so
that other jobs on the machine slow every algorithm alike. (The seconds
recorded during the benchmark runs depend on what else ran at the time.)

    python -m research.local_cost   # writes bench/results/algorithms_local_cost.json
"""

from __future__ import annotations

import json
import statistics

from broker_coordinator.settings.round_settings import RoundSettings
from edge_agent.device_step import local_settings
from edge_agent.training import train_locally
from edgefl_protocol import algorithms
from edgefl_models.architectures import build_model

from bench import fedsim, provenance, settings
from bench.algorithms import BASELINES, CPU_SIZED, DEFAULT, MOMENTUM, RESULTS

REPEATS = 3
CLIENTS = (3, 9)  # 426 and 450 samples: 28-30 steps a round at batch 32


def main() -> int:
    fedsim.set_threads(1)
    fed = settings.headline()
    variants = BASELINES + [DEFAULT] + CPU_SIZED
    seconds: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for momentum in (0.0, MOMENTUM):
            for v in variants:
                rs = RoundSettings(algorithm=v.algorithm, momentum=momentum, hparams=dict(v.hparams))
                hp = rs.task_hparams(5)
                for c in CLIENTS:
                    rule = algorithms.get(v.algorithm).client(hp, {"round": 5, "warmup": False}, {})
                    out = train_locally(build_model(fed.arch, 0), fed.clients[c], rule, local_settings(hp), c)
                    key = v.name + ("+momentum" if momentum else "")
                    seconds.setdefault(key, []).append(float(out.metrics["train_seconds"]))
    table = {}
    for key, values in seconds.items():
        ref = seconds["fedavg+momentum" if key.endswith("+momentum") else "fedavg"]
        table[key] = {"median_seconds": statistics.median(values),
                      "vs_fedavg_same_optimizer": statistics.median(values) / statistics.median(ref)}
        print(f"{key:28s} {table[key]['median_seconds']:.3f} s  {table[key]['vs_fedavg_same_optimizer']:.2f}x")
    measured = provenance.measured_with(
        provenance.invoked(), {"local_epochs": RoundSettings().local_epochs},
        varies={"algorithm": "per row", "momentum": [0.0, MOMENTUM]}, data="mnist5k",
        partition="bench/data/mnist5k_dir01_20clients.npz", clients=list(CLIENTS),
        note="local training only (one process, one thread): no codec, downlink or aggregation")
    (RESULTS / "algorithms_local_cost.json").write_text(json.dumps(
        {"clients": list(CLIENTS), "repeats": REPEATS, "per_algorithm": table, "measured_with": measured},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
