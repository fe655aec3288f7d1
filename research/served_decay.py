"""What the served model's decay does to the cross-settings rows (a benchmark that runs nothing new).

Every field-settings run (bench/field_settings.py) evaluates, each round, the last global model and the
moving averages of the global models at decays 0.5, 0.75 and 0.9 that a coordinator with that
`[rounds] serve_average` would serve. The averages never feed back into training, so one set of runs
measures every decay exactly. This reads the cached runs and, per decay, rebuilds the rows, the choice by
the same rule and the late-decline count (rows ending more than 1 point below their own best in some
seed), so a change of the shipped `serve_average` can be judged on the whole matrix.

    python -m research.served_decay     # seconds; needs the runs of `python -m bench.field_settings`

Writes bench/results/served_decay.json and served_decay.md.
"""

from __future__ import annotations

import json

from bench import provenance
from bench.algorithm_jobs import RESULTS
from bench.field_report import mean
from bench.field_settings import PIPELINE, SEEDS, SETTINGS, cached, every_cached_job
from bench.field_settings_report import STABLE_WITHIN, choose, client_of, shipped_row, summarize

DECAYS = (0.0, 0.5, 0.75, 0.9)  # 0: the last global model; the others are what fedsim.py evaluates


def at_decay(records: list[dict], decay: float, default_row: str) -> dict:
    table = summarize(records, decay)
    choice = choose(table, SETTINGS, len(SEEDS))
    out: dict = {"choice": choice["row"], "worst_case_vs_fedavg": choice.get("worst_case_vs_fedavg"),
                 "settings": {}}
    for setting in SETTINGS:
        rows = table.get(setting, {})
        full = {r: v for r, v in rows.items() if len(v["seeds"]) == len(SEEDS)}
        unstable = sorted(r for r, v in full.items() if v["final_minus_best_worst"] < -STABLE_WITHIN)
        mine, base = full.get(default_row), full.get(f"fedavg+{client_of(default_row)}")
        out["settings"][setting] = {
            "rows": len(full), "unstable_rows": unstable,
            "default_final": round(mean(mine["final_accuracy"]), 2) if mine else None,
            "default_vs_fedavg": round(mean(mine["final_accuracy"]) - mean(base["final_accuracy"]), 2)
            if mine and base else None,
            "default_final_minus_best_worst": mine["final_minus_best_worst"] if mine else None}
    return out


def markdown(results: dict[str, dict], default_row: str, measured: dict) -> str:
    lines = ["# The served model's decay across settings", "",
             f"`{measured['command']}`: the cached field-settings runs ({len(SEEDS)} seeds) re-scored at each "
             "`serve_average` (0 = the last global model); the averages never feed back into training, so each "
             f"column is exact. Rows that end more than {STABLE_WITHIN:g} point below their own best in some seed, "
             f"and the default row `{default_row}`'s final % (points over FedAvg with the same client optimizer; "
             "its worst final - best).", "",
             "| serve_average | choice (worst case) | " + " | ".join(SETTINGS) + " |",
             "|---|---|" + "---|" * len(SETTINGS)]
    for decay, r in results.items():
        cells = []
        for s in SETTINGS:
            v = r["settings"][s]
            cells.append(f"{len(v['unstable_rows'])} of {v['rows']} rows; {v['default_final']:.2f} "
                         f"({v['default_vs_fedavg']:+.2f}; {v['default_final_minus_best_worst']:+.2f})")
        lines.append(f"| {decay} | {r['choice']} ({r['worst_case_vs_fedavg']:+.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from broker_coordinator.settings.round_settings import RoundSettings
    shipped = RoundSettings()
    default_row = shipped_row(shipped)
    records = cached(every_cached_job())
    if not records:
        raise SystemExit(f"no cached runs in bench/results/algorithms_runs/{PIPELINE}/: run python -m "
                         "bench.field_settings first")
    results = {f"{d:g}": at_decay(records, d, default_row) for d in DECAYS}
    measured = provenance.measured_with(
        provenance.invoked(), {k: v for k, v in provenance.deciding(shipped).items()
                               if k not in ("algorithm", "momentum", "server_optimizer", "server_lr",
                                            "serve_average")},
        varies={"serve_average": list(DECAYS), "rows": "field_settings' rows"},
        runs=f"bench/results/algorithms_runs/{PIPELINE}/ (python -m bench.field_settings)",
        run_commits=sorted({r.get("commit", "unknown") for r in records}))
    (RESULTS / "served_decay.json").write_text(json.dumps({"measured_with": measured, "default_row": default_row,
                                                           "by_serve_average": results}, indent=1) + "\n")
    text = markdown(results, default_row, measured)
    (RESULTS / "served_decay.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
