"""Every cached run's final numbers in one tracked file: bench/results/runs_digest.json.

The benchmarks cache each finished run in bench/results/<name>_runs/ (resumable, and read again by
`--report`). Those caches stay on the machine that made them (.gitignore); their summaries
(field.json, attacks.json, privacy.json, ...) are tracked. Some runs are in no summary: one-seed
probes run with other flags (the privacy runs the docs quote beside privacy.json's rows), and older
pipelines' runs. This keeps, for every cached run, its last round's numbers and the commit it was
measured at, so that a number quoted from a cache can be checked on a clean clone.

    python -m bench.runs_digest       # after a benchmark added runs to a cache

An entry is keyed by the run's path under bench/results/ and holds: every numeric scalar at the top
level of the run's JSON; the last value of every accuracy, loss or score series (`accuracy[-1]`,
`ema_accuracy[0.75][-1]`); the last two rounds' of the same in `rounds` or `trace`
(`rounds[-1].accuracy`, `trace[-2].accuracy`); and `commit`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from . import provenance

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "runs_digest.json"
SERIES = re.compile(r"accuracy|loss|score|success")
DIGITS = 4


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_number(v) for v in value)


def digest(run: dict) -> dict[str, Any]:
    """The final numbers of one cached run (see the module's docstring)."""
    out: dict[str, Any] = {}
    for key, value in run.items():
        if _number(value):
            out[key] = round(value, DIGITS)
        elif SERIES.search(key) and _series(value):
            out[f"{key}[-1]"] = round(value[-1], DIGITS)
        elif SERIES.search(key) and isinstance(value, dict):
            for sub, series in value.items():
                if _series(series):
                    out[f"{key}[{sub}][-1]"] = round(series[-1], DIGITS)
        elif key in ("rounds", "trace") and isinstance(value, list) and value and isinstance(value[-1], dict):
            for back in (-2, -1):
                if len(value) >= -back:
                    out.update({f"{key}[{back}].{k}": round(v, DIGITS) for k, v in value[back].items()
                                if SERIES.search(k) and _number(v)})
    commit = run.get("commit") or (run.get("measured_with") or {}).get("commit")
    if commit:
        out["commit"] = commit
    return out


def cached_runs(results: Path = RESULTS) -> dict[str, dict]:
    """{path under results/: digest} for every JSON in every <name>_runs/ cache (raw logs left out)."""
    runs = {}
    for path in sorted(results.glob("*_runs/**/*.json")):
        if "logs" in path.relative_to(results).parts:
            continue
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a run being written by another process
        if isinstance(run, dict):
            runs[str(path.relative_to(results))] = digest(run)
    return runs


def main() -> int:
    runs = cached_runs()
    if not runs:
        raise SystemExit(f"no cached runs under {RESULTS}/*_runs/: run the benchmarks first")
    previous = json.loads(OUT.read_text())["runs"] if OUT.exists() else {}
    kept = {k: v for k, v in previous.items() if k not in runs}  # runs cached on another machine
    measured = provenance.measured_with(
        provenance.invoked(), {}, runs="each entry's own commit: the runs were measured by their benchmarks",
        note="the final numbers of every run cached in bench/results/*_runs/ (the caches are not in git)")
    lines = [f"  {json.dumps(path)}: {json.dumps(entry)}" for path, entry in sorted({**kept, **runs}.items())]
    head = f'{{"measured_with": {json.dumps(measured, indent=1)},\n "runs": {{\n'
    OUT.write_text(head + ",\n".join(lines) + "\n}}\n")  # one run a line: a rerun changes its own lines
    print(f"{len(runs)} cached runs ({len(kept)} more kept from the previous digest) -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
