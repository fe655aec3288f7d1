"""The measurement behind buffered mode's dual algorithms: the server dual paced by the buffer.

Runs `simulate` in buffered mode (digits, 6 agents, K = 3, 15 versions, central evaluation) for
`dynsam` (the default, its dual on), `feddyn` and `fedsmoo` as they ship: H adds the undamped mean and enters
the model as H / (1 + s)^2 for the buffer's mean staleness s (`ServerRule.pace`,
edgefl_protocol/algorithms/feddyn.py). Beside them: `dynsam` with H whole (the rule before `pace`:
`pace` disabled for this process only, the measurement that once refused these algorithms),
`dynsam` with `dual = 0`, and `fedavg`; seeds 0 and 1. Writes bench/results/buffered_duals.json
and .md: accuracy and loss per version.

    python -m research.buffered_duals
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from broker_coordinator.settings.round_settings import RoundSettings
from broker_coordinator.simulation.simulate import SimulationSpec, simulate
from edgefl_protocol.algorithms.base import ServerRule

from bench import provenance

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
# row -> (algorithm, hparams, paced)
ROWS = {"dynsam": ("dynsam", {}, True), "dynsam, H whole": ("dynsam", {}, False), "feddyn": ("feddyn", {}, True),
        "fedsmoo": ("fedsmoo", {}, True), "dynsam dual=0": ("dynsam", {"dual": 0}, True), "fedavg": ("fedavg", {}, True)}
SEEDS, VERSIONS, AGENTS, K = (0, 1), 15, 6, 3


def run(algorithm: str, hparams: dict, paced: bool, seed: int) -> dict:
    settings = RoundSettings(algorithm=algorithm, hparams=hparams, mode="buffered", buffer_size=K,
                             round_timeout=20.0)
    pace = ServerRule.pace
    if not paced:
        ServerRule.pace = lambda self, damping, delay: None  # type: ignore[method-assign]  # this process only
    try:
        with tempfile.TemporaryDirectory(prefix="edgefl-duals-") as tmp:
            history = simulate(SimulationSpec(agents=AGENTS, rounds=VERSIONS, dataset="digits", seed=seed,
                                              out=Path(tmp), federation="duals"), settings, echo=lambda line: None)
    finally:
        ServerRule.pace = pace  # type: ignore[method-assign]
    return {"accuracy": [round(r["score"], 4) for r in history], "loss": [round(r["loss"], 4) for r in history]}


def main() -> int:
    runs = {name: {str(seed): run(*row, seed) for seed in SEEDS} for name, row in ROWS.items()}
    out = {"measured_with": provenance.measured_with(
               provenance.invoked(), provenance.deciding(RoundSettings(mode="buffered", buffer_size=K)),
               data="digits (sklearn)", agents=AGENTS, versions=VERSIONS, seeds=list(SEEDS), round_timeout=20.0,
               varies={"algorithm": list(ROWS)},
               note="'dynsam, H whole' disables ServerRule.pace for its runs only (the rule before it)"),
           "runs": runs,
           "final_mean": {name: round(100 * statistics.mean(r["accuracy"][-1] for r in seeds.values()), 2)
                          for name, seeds in runs.items()},
           "peak_loss": {name: max(max(r["loss"]) for r in seeds.values()) for name, seeds in runs.items()}}
    (RESULTS / "buffered_duals.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# Buffered mode with a server dual (digits, {AGENTS} agents, K = {K}, {VERSIONS} versions)", "",
             f"Command: `{out['measured_with']['command']}` at {out['measured_with']['commit']}. Accuracy per "
             "version (central test set), per seed. `dynsam` and `feddyn` as they ship (H paced by the buffer's "
             "staleness); `dynsam, H whole`: the rule before it.", "",
             "| row | seed | accuracy per version | loss per version |", "| --- | ---: | --- | --- |"]
    for name, seeds in runs.items():
        for seed, r in seeds.items():
            lines.append(f"| {name} | {seed} | {' '.join(f'{100 * a:.1f}' for a in r['accuracy'])} | "
                         f"{' '.join(f'{x:.2f}' for x in r['loss'])} |")
    lines += ["", "| row | final accuracy, mean of seeds | highest loss |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {out['final_mean'][name]:.2f} | {out['peak_loss'][name]:.2f} |" for name in runs]
    (RESULTS / "buffered_duals.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
