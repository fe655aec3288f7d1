"""The whole test suite, N times, with every core kept busy: which tests depend on the machine's speed.

    python -m checks.test_soak --runs 5                # `make test-soak` (SOAK_ARGS="--runs 2")
    python -m checks.test_soak --runs 3 --only tests/test_examples_e2e.py::test_sensor_example_learns_from_growing_spools

A CPU hog (one busy-loop process per core, at the niceness this script runs with: `make test-soak`
runs it at 0) competes with the tests for the whole time; it is stopped exactly by the PIDs this
script started. Each run is `python -m pytest -q -p no:cacheprovider --junitxml=...` (xunit1, so each
case names its file) into a temporary directory; failed or errored cases are counted by test id
(`--keep-logs` keeps each run's log and xml). The whole suite writes bench/results/test_soak.json
and test_soak.md after every run, so a soak stopped early keeps the runs it finished ("runs" says
how many, "runs_requested" how many were asked for); `--only` runs just the named tests and prints
the counts without writing the result files.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BUSY_LOOP = "while True:\n    pass\n"


class Hog:
    """One busy-loop process per core; stops exactly the processes it started."""

    def __init__(self, cores: int) -> None:
        self.cores = cores
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> "Hog":
        for _ in range(self.cores):
            self.processes.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def describe(self) -> str:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        return (f"{self.cores} busy-loop process{'es' if self.cores != 1 else ''} on {os.cpu_count()} "
                f"cores (nice {nice})")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    # the result files themselves are written by this run: they do not make the code dirty
    dirty = [line for line in git("status", "--porcelain").splitlines()
             if not line[3:].startswith("bench/results/test_soak.")]
    return head + ("-dirty" if dirty else "")


def failed_ids(junit: Path) -> list[str]:
    """Test ids (path::Class::name[param]) of the failed or errored cases in a junit xml (xunit1)."""
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is None and case.find("error") is None:
            continue
        path = case.get("file") or ""
        classname = case.get("classname", "")
        module = path[:-3].replace("/", ".") if path.endswith(".py") else ""
        inside = classname[len(module) + 1:] if module and classname.startswith(module + ".") else ""
        found.append("::".join(p for p in (path or classname, inside, case.get("name", "")) if p))
    return sorted(set(found))


def run_suite(out: Path, index: int, tests: list[str]) -> tuple[float, list[str], int]:
    junit = out / f"run-{index}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
               f"--junitxml={junit}", *tests]
    log = out / f"run-{index}.log"
    start = time.monotonic()
    with open(log, "w") as handle:
        code = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    failures = failed_ids(junit) if junit.exists() else []
    if code not in (0, 1) or (code == 1 and not failures):  # pytest itself failed: say so, with its log
        failures.append(f"<pytest exit {code}: see {log}>")
    tail = "".join(log.read_text().splitlines(keepends=True)[-1:]).strip()
    print(f"run {index}: {seconds:.0f} s, {len(failures)} failed: {tail}", flush=True)
    for test in failures:
        print(f"    {test}", flush=True)
    return seconds, failures, code


def write_markdown(result: dict, path: Path) -> None:
    runs, made = result["runs"], result["measured_with"]
    lines = ["# Test soak", "",
             f"Written by `{made['command']}` at commit `{made['commit'][:12]}`: the whole suite "
             f"{runs} time{'s' if runs != 1 else ''} (of {result['runs_requested']} requested) "
             f"while {result['load']} kept every core busy.", "",
             "| run | seconds | failed |", "| --- | ---: | ---: |"]
    for k, (seconds, failed) in enumerate(zip(result["seconds"], result["failed_per_run"]), 1):
        lines.append(f"| {k} | {seconds:.0f} | {failed} |")
    lines += ["", "| test | failed in runs |", "| --- | ---: |"]
    lines += [f"| `{test}` | {count} of {result['runs']} |" for test, count in result["failures"].items()]
    if not result["failures"]:
        lines.append(f"| (none) | 0 of {result['runs']} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checks.test_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="how many times to run the suite (default 5)")
    parser.add_argument("--only", action="append", default=[], metavar="TESTID",
                        help="run only this test id (repeatable); prints the counts, writes no result files")
    parser.add_argument("--cores", type=int, default=usable_cores(), help="busy-loop processes (default: one a core)")
    parser.add_argument("--keep-logs", action="store_true", help="keep each run's pytest log and junit xml")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.cores < 0:
        parser.error("--runs must be >= 1 and --cores >= 0")

    # a SIGTERM (make interrupted, a job stopped) must still stop the hog: turn it into an exception
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    command = "python -m checks.test_soak --runs " + str(args.runs) + "".join(f" --only {t}" for t in args.only)
    seconds, per_run, failures = [], [], Counter()
    with tempfile.TemporaryDirectory(prefix="edgefl-soak-") as scratch, Hog(args.cores) as hog:
        tmp = tempfile.mkdtemp(prefix="edgefl-soak-logs-") if args.keep_logs else scratch
        load = hog.describe()
        print(f"test soak: {args.runs} runs of {' '.join(args.only) or 'the whole suite'} under {load}; "
              f"logs in {tmp}", flush=True)
        for index in range(1, args.runs + 1):
            took, failed, _ = run_suite(Path(tmp), index, args.only)
            seconds.append(round(took, 1))
            per_run.append(len(failed))
            failures.update(failed)
            # after every run, so that a soak stopped early keeps the runs it finished ("runs" says how many)
            result = {"measured_with": {"commit": commit(), "command": command, "load": load},
                      "runs": index, "runs_requested": args.runs, "load": load, "seconds": seconds,
                      "failed_per_run": per_run,
                      "failures": dict(sorted(failures.items(), key=lambda kv: (-kv[1], kv[0])))}
            if not args.only:
                RESULTS.mkdir(parents=True, exist_ok=True)
                (RESULTS / "test_soak.json").write_text(json.dumps(result, indent=1) + "\n")
                write_markdown(result, RESULTS / "test_soak.md")
    print(json.dumps({k: result[k] for k in ("runs", "seconds", "failures")}, indent=1))
    if not args.only:
        print(f"wrote {RESULTS / 'test_soak.json'} and test_soak.md")
    return 1 if failures else 0

if __name__ == "__main__":
    sys.exit(main())
