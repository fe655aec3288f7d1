"""The measurement behind one refusal of `composition`: buffered mode with a server dual.

Runs `simulate` in buffered mode (digits, 6 agents, K = 3, 5 versions, central evaluation) with
the refusal of dual algorithms lifted for this process only, for `dynsam` (its dual on, the
default) and, as the reference, `fedavg` and `dynsam` with `dual = 0`; seeds 0 and 1. Writes
bench/results/buffered_duals.json and .md: accuracy and loss per version.

    python -m bench.buffered_duals
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from broker_coordinator.settings import composition
from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.simulate import SimulationSpec, simulate

from . import provenance

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = {"dynsam": {}, "dynsam dual=0": {"dual": 0}, "fedavg": None}
SEEDS, VERSIONS, AGENTS, K = (0, 1), 5, 6, 3


def run(name: str, hparams: dict | None, seed: int) -> dict:
    algorithm = "fedavg" if hparams is None else "dynsam"
    settings = RoundSettings(algorithm=algorithm, hparams=hparams or {}, mode="buffered", buffer_size=K,
                             round_timeout=20.0)
    with tempfile.TemporaryDirectory(prefix="edgefl-duals-") as tmp:
        history = simulate(SimulationSpec(agents=AGENTS, rounds=VERSIONS, dataset="digits", seed=seed, out=Path(tmp),
                                          federation="duals"), settings, echo=lambda line: None)
    return {"accuracy": [round(r["score"], 4) for r in history], "loss": [round(r["loss"], 4) for r in history]}


def main() -> int:
    rules = composition.RULES
    composition.RULES = tuple(r for r in rules if "dual" not in r.combination)  # this process only
    try:
        runs = {name: {str(seed): run(name, hparams, seed) for seed in SEEDS} for name, hparams in ROWS.items()}
    finally:
        composition.RULES = rules
    out = {"measured_with": provenance.measured_with(
               provenance.invoked(), provenance.deciding(RoundSettings(mode="buffered", buffer_size=K)),
               data="digits (sklearn)", agents=AGENTS, versions=VERSIONS, seeds=list(SEEDS), round_timeout=20.0,
               varies={"algorithm": list(ROWS)}, note="the buffered-dual refusal lifted for this process only"),
           "runs": runs}
    (RESULTS / "buffered_duals.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = ["# Buffered mode with a server dual (digits, 6 agents, K = 3)", "",
             f"Command: `{out['measured_with']['command']}` at {out['measured_with']['commit']}. Accuracy per "
             "version (central test set), per seed.", "", "| row | seed | accuracy per version | loss per version |",
             "| --- | ---: | --- | --- |"]
    for name, seeds in runs.items():
        for seed, r in seeds.items():
            lines.append(f"| {name} | {seed} | {' '.join(f'{100 * a:.1f}' for a in r['accuracy'])} | "
                         f"{' '.join(f'{x:.2f}' for x in r['loss'])} |")
    (RESULTS / "buffered_duals.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
