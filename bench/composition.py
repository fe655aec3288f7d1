"""Every combination of the engine's choices, run for real (issue 19): `make composition`.

Cells: {sync, buffered} x {flat, sites} x {dynsam, fedavg, feddyn} x {the default fold, mean} x
{full, delta downlink} x {central, device evaluation}. A cell that `composition` refuses is
recorded with the rule's reason; every other cell runs `broker-coordinator simulate` in process
(real Mosquitto brokers, bridged for sites, and real agent processes training on digits) and must
end with a better model than it started from: the final score above the untrained model's, on the
coordinator's test set. Every cell gets the same device work: a sync cell runs `--versions` rounds
of every device, a buffered cell versions x agents / K versions of K = 3 updates (with half of it,
3 versions of 3 updates, `dynsam` in flat buffered cells was still at chance in 5 of 8 cells: a
stale second buffer trained on the untrained model overshoots, and recovers within the next few). A device-evaluation cell also evaluates on the devices, and must carry
their federated scores (`devices_scores`): the devices' held-out slices differ between versions'
reporters, so they are the feature under test, not the yardstick.

    python -m bench.composition                 # every cell: bench/results/composition.json, .md
    python -m bench.composition --pairwise      # a pairwise-covering subset (what `make test` runs)

`tests/test_composition_e2e.py` runs the pairwise subset with fewer rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from broker_coordinator.settings import composition
from broker_coordinator.aggregation.robust import DEFAULT_AGGREGATOR
from broker_coordinator.settings.round_settings import RoundSettings

from . import provenance

RESULTS = Path(__file__).resolve().parent / "results"
AXES = {
    "schedule": ("sync", "buffered"),
    "topology": ("flat", "sites"),
    "algorithm": ("dynsam", "fedavg", "feddyn"),
    "fold": ("default", "mean"),
    "downlink": ("full", "delta"),
    "evaluate": ("central", "devices"),
}
AGENTS, VERSIONS, SITES = 6, 3, 2
BUFFER = 3  # K of the buffered cells


@dataclass(frozen=True)
class Cell:
    schedule: str
    topology: str
    algorithm: str
    fold: str
    downlink: str
    evaluate: str

    def settings(self, round_timeout: float = 20.0) -> RoundSettings:
        # a device-evaluation cell evaluates on the devices *and* centrally: the devices' scores are
        # the feature under test, the central test set is the yardstick (the devices' held-out slices
        # differ from one version's reporters to the next, so their scores do not compare across
        # versions, least of all in buffered mode)
        return RoundSettings(algorithm=self.algorithm, mode=self.schedule, downlink=self.downlink,
                             aggregator=DEFAULT_AGGREGATOR if self.fold == "default" else "mean",
                             evaluate="central" if self.evaluate == "central" else "both",
                             round_timeout=round_timeout, buffer_size=BUFFER)

    def name(self) -> str:
        return "/".join(asdict(self).values())


def cells() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*AXES.values())]


def refusal(cell: Cell) -> str:
    """Why `composition` refuses the cell ("" = it runs)."""
    try:
        cell.settings().validate()
        composition.check(cell.settings(), cell.topology)
    except ValueError as exc:
        return str(exc)
    return ""


def pairwise(candidates: list[Cell]) -> list[Cell]:
    """A smallest subset of `candidates` covering every pair of axis values that some candidate has
    (an exhaustive search by increasing size; the cells in `candidates` order). A greedy cover took
    9 cells where 7 do, and each cell is a federation of real processes."""
    keys = list(AXES)

    def pairs(cell: Cell) -> set[tuple]:
        values = asdict(cell)
        return {((a, values[a]), (b, values[b])) for a, b in itertools.combinations(keys, 2)}

    index = {pair: i for i, pair in enumerate(sorted(set().union(*(pairs(c) for c in candidates))))}
    masks = [sum(1 << index[p] for p in pairs(c)) for c in candidates]  # the pairs each cell covers
    covering = [[k for k, mask in enumerate(masks) if mask >> i & 1] for i in range(len(index))]
    widest = max((mask.bit_count() for mask in masks), default=1)

    def search(uncovered: int, chosen: list[int], limit: int) -> list[int] | None:
        if not uncovered:
            return chosen
        if len(chosen) + -(-uncovered.bit_count() // widest) > limit:
            return None  # even cells covering `widest` new pairs each would not reach it within `limit`
        rarest = min((i for i in range(len(index)) if uncovered >> i & 1), key=lambda i: len(covering[i]))
        for k in covering[rarest]:  # some chosen cell must cover the pair that fewest cells cover
            if (found := search(uncovered & ~masks[k], [*chosen, k], limit)) is not None:
                return found
        return None

    for limit in range(len(candidates) + 1):
        if (found := search((1 << len(index)) - 1, [], limit)) is not None:
            return [candidates[k] for k in sorted(found)]
    return list(candidates)  # not reached: all the candidates cover every pair


def untrained_score(arch: str, seed: int) -> float:
    """The central metric of the model every cell starts from (models.build_model(arch, seed))."""
    from edgefl_models import datasets
    from edgefl_models.architectures import build_model
    from edgefl_models.objectives import Objective
    return Objective().evaluate(build_model(arch, seed), datasets.load("digits").test).score


def run_cell(cell: Cell, workdir: Path, agents: int = AGENTS, versions: int = VERSIONS, seed: int = 0,
             settings: RoundSettings | None = None) -> dict:
    """Run one cell through `simulate` (with `settings`, e.g. the cell's plus a stage under test, instead
    of the cell's own); its record (ok, first/final score, detail). The rounds are in workdir/history.json."""
    from broker_coordinator.simulation.simulate import SimulationSpec, simulate

    if cell.schedule == "buffered":  # the sync cells' device work: `versions` updates of every device
        versions = -(-versions * agents // BUFFER)
    spec = SimulationSpec(agents=agents, rounds=versions, dataset="digits", seed=seed, out=workdir,
                          federation="comp", sites=SITES if cell.topology == "sites" else 0)
    lines: list[str] = []
    started = time.monotonic()
    history = simulate(spec, settings or cell.settings(), echo=lines.append)
    first, final = untrained_score("digits_mlp", seed), history[-1]["score"]
    reported = [r["federated"]["score"] for r in history if r.get("federated")]
    ok = bool(final > first) and (cell.evaluate == "central" or bool(reported))
    return {**asdict(cell), "ok": ok, "first_score": round(first, 4), "final_score": round(final, 4),
            "devices_scores": [round(x, 4) for x in reported],
            "detail": f"{len(history)} versions in {time.monotonic() - started:.0f} s; "
                      f"participants {[r['participants'] for r in history]}; last line: {lines[-2] if len(lines) > 1 else ''}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairwise", action="store_true", help="only a pairwise-covering subset of the cells")
    parser.add_argument("--versions", type=int, default=VERSIONS)
    parser.add_argument("--where", nargs="+", metavar="AXIS=VALUE", default=[],
                        help="only the cells with these values (e.g. schedule=buffered topology=sites): "
                             "bench/results/composition_subset.json, .md")
    parser.add_argument("--rerun-failed", type=int, nargs="+", metavar="SEED",
                        help="rerun the cells composition.json records as failed, with these seeds: "
                             "bench/results/composition_reruns.json (a failure that holds, or noise)")
    args = parser.parse_args(argv)
    if args.rerun_failed:
        return rerun_failed(args.rerun_failed, args.versions)
    refused, runnable = [], []
    for cell in cells():
        why = refusal(cell)
        (refused.append({"combination": cell.name(), "reason": why}) if why else runnable.append(cell))
    where = dict(item.split("=", 1) for item in args.where)
    if unknown := set(where) - set(AXES):
        parser.error(f"--where names no axis {sorted(unknown)}; the axes are {', '.join(AXES)}")
    runnable = [c for c in runnable if all(asdict(c)[k] == v for k, v in where.items())]
    chosen = pairwise(runnable) if args.pairwise else runnable
    results = []
    for i, cell in enumerate(chosen, 1):
        with tempfile.TemporaryDirectory(prefix="edgefl-composition-") as tmp:
            try:
                row = run_cell(cell, Path(tmp), versions=args.versions)
            except Exception as exc:  # a cell that breaks is a result, not the end of the benchmark
                row = {**asdict(cell), "ok": False, "first_score": None, "final_score": None,
                       "detail": f"{type(exc).__name__}: {exc}"}
        results.append(row)
        print(f"[{i}/{len(chosen)}] {cell.name()}: {'ok' if row['ok'] else 'FAILED'} "
              f"{row['first_score']} -> {row['final_score']}", flush=True)
    out = {"measured_with": provenance.measured_with(
               provenance.invoked(), provenance.deciding(RoundSettings()), data="digits (sklearn)", agents=AGENTS,
               versions=args.versions, sites=SITES, round_timeout=20.0, buffer_size=BUFFER, seeds=[0],
               buffered_versions=-(-args.versions * AGENTS // BUFFER),  # the sync cells' device work
               varies={k: list(v) for k, v in AXES.items()},
               subset="pairwise" if args.pairwise else (" ".join(args.where) if where else "all")),
           "cells": results, "refused": refused}
    name = "composition_pairwise" if args.pairwise else ("composition_subset" if where else "composition")
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    rows = ["| schedule | topology | algorithm | fold | downlink | evaluate | ok | first | final |",
            "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: |"]
    rows += [f"| {r['schedule']} | {r['topology']} | {r['algorithm']} | {r['fold']} | {r['downlink']} | "
             f"{r['evaluate']} | {'yes' if r['ok'] else '**no**'} | {r['first_score']} | {r['final_score']} |"
             for r in results]
    reasons = sorted({r["reason"] for r in refused})
    text = (f"# Composition ({len(results)} cells run, {sum(r['ok'] for r in results)} ok; {len(refused)} refused)\n\n"
            f"Command: `{out['measured_with']['command']}` at {out['measured_with']['commit']}.\n\n"
            + "\n".join(rows) + "\n\n## Refused, and why\n\n" + "\n".join(f"- {r}" for r in reasons) + "\n")
    (RESULTS / f"{name}.md").write_text(text)
    print(f"wrote {RESULTS / name}.json and .md")
    return 0 if all(r["ok"] for r in results) else 1


def rerun_failed(seeds: list[int], versions: int) -> int:
    """The failed cells of the last full run again, once per seed, beside (not instead of) it."""
    full = json.loads((RESULTS / "composition.json").read_text())
    failed = [Cell(*(row[k] for k in AXES)) for row in full["cells"] if not row["ok"]]
    rows = []
    for cell in failed:
        for seed in seeds:
            with tempfile.TemporaryDirectory(prefix="edgefl-composition-") as tmp:
                row = {**run_cell(cell, Path(tmp), versions=versions, seed=seed), "seed": seed}
            rows.append(row)
            print(f"{cell.name()} seed {seed}: {'ok' if row['ok'] else 'FAILED'} "
                  f"{row['first_score']} -> {row['final_score']}", flush=True)
    out = {"measured_with": provenance.measured_with(
               provenance.invoked(), provenance.deciding(RoundSettings()), data="digits (sklearn)", agents=AGENTS,
               versions=versions, sites=SITES, round_timeout=20.0, buffer_size=BUFFER, seeds=seeds,
               reruns_of=f"composition.json at {full['measured_with']['commit']}"),
           "cells": rows}
    (RESULTS / "composition_reruns.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
