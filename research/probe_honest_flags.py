"""A probe: what the agreement stage costs honest devices of skewed data, at `agreement_flags` 1 (the
default: a device's weight falls from its first flag in its last 5 judged updates) and 2.

The clean runs of `make field-settings` (bench/field_settings.py: the shipped default row `dynsam+sgd`,
40 rounds, 3 seeds, the pinned host speed) on its three settings, once per value: no device lies, so
every update folded below its full weight is an honest one down-weighted. Per setting and value: the
share of updates down-weighted, the least weight one kept, and the final accuracy (the served model).
What it measured is in docs/RESEARCH.md, "Robust aggregation".

    python -m research.probe_honest_flags 1,2 1,2,3
"""

from __future__ import annotations

import sys

import numpy as np

from bench import fedsim, settings
from bench.algorithms import ROUND_TIMEOUT, fleet_for
from bench.field_settings import SETTINGS
from bench.field_settings_report import honest_weights
from broker_coordinator.settings.round_settings import RoundSettings


def clean_run(setting: str, flags: int, seed: int) -> dict:
    fed = settings.SETTINGS[setting]()
    rs = RoundSettings(algorithm="dynsam", clients_per_round=fed.clients_per_round, momentum=0.0,
                       round_timeout=ROUND_TIMEOUT, agreement_flags=flags)
    result = fedsim.run(fed, rs, seed=seed, keep_signals=True, fleet=fleet_for(len(fed.clients), seed))
    return {**honest_weights([{"signals": result.signals}]), "final": result.served_accuracy[-1]}


def main(values: list[int], seeds: list[int]) -> None:
    fedsim.set_threads(1)
    for setting in SETTINGS:
        for flags in values:
            runs = [clean_run(setting, flags, seed) for seed in seeds]
            shares = [100 * r["honest_down_weighted"] for r in runs]
            print(f"{setting}, agreement_flags {flags}, seeds {seeds}: honest updates down-weighted "
                  f"{np.mean(shares):.1f}% (per seed {', '.join(f'{s:.1f}' for s in shares)}), least weight "
                  f"{min(r['honest_min_weight'] for r in runs):.2f}, final served accuracy "
                  f"{100 * np.mean([r['final'] for r in runs]):.2f}%", flush=True)


if __name__ == "__main__":
    main([int(v) for v in sys.argv[1].split(",")], [int(s) for s in sys.argv[2].split(",")])
