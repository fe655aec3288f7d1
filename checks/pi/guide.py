"""The command blocks of docs/OPERATOR.md, as the checks run them: found by their HTML comment markers.

A block is the indented lines between `<!-- edgefl:NAME -->` and `<!-- /edgefl:NAME -->`, one
command a line, exactly as an operator copies them. The operator's own machine runs
`make dist` and copies the wheel with `scp dist/WHEEL HOST:DIR`; a check has no ssh to its
root, so it runs the same `make dist` here and puts the wheel it built in the root's DIR,
where the guide's next block installs it from.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
GUIDE = PROJECT / "docs" / "OPERATOR.md"


class GuideError(Exception):
    """The guide and what the check finds disagree; the message says which line to fix."""


def block(name: str, guide: Path = GUIDE) -> list[str]:
    text = guide.read_text()
    found = re.search(rf"^<!-- edgefl:{re.escape(name)} -->\n(.*?)^<!-- /edgefl:{re.escape(name)} -->$", text,
                      re.M | re.S)
    if found is None:
        raise GuideError(f"{guide.name} has no block marked <!-- edgefl:{name} --> ... <!-- /edgefl:{name} -->")
    lines = [line[4:] for line in found.group(1).splitlines() if line.startswith("    ") and line.strip()]
    if not lines:
        raise GuideError(f"the block edgefl:{name} of {guide.name} holds no indented command")
    return lines


def scp_line(line: str) -> tuple[Path, str] | None:
    """(the local file, the directory on the remote machine) of `scp FILE HOST:DIR`, else None."""
    words = shlex.split(line)
    if len(words) != 3 or words[0] != "scp" or ":" not in words[2]:
        return None
    directory = words[2].split(":", 1)[1] or "~"
    return PROJECT / words[1], directory


def commit() -> str:
    """This checkout's commit, marked when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT,
                           capture_output=True, text=True).stdout.strip()
    return (head + ("+uncommitted changes" if dirty else "")) if head else "unknown"


def operator_side(name: str, root: Path, home: str = "/root", skip_scp: bool = False, echo=print) -> list[dict]:
    """Run a block of the operator's machine here (in this checkout); each scp copies into `root` instead
    (or, with skip_scp, is left out: a copy to another machine than the one checked)."""
    steps = []
    for line in block(name):
        copied = scp_line(line)
        if copied is not None and skip_scp:
            steps.append({"command": line, "ran": "not here: it copies to another machine than the one checked"})
            continue
        if copied is None:
            echo(f"  [operator's machine] {line}")
            done = subprocess.run(["/bin/sh", "-c", line], cwd=PROJECT, capture_output=True, text=True)
            steps.append({"command": line, "ran": "on this machine, in the checkout", "exit": done.returncode,
                          "output": (done.stdout + done.stderr).strip().splitlines()[-3:]})
            if done.returncode != 0:
                raise GuideError(f"'{line}' (edgefl:{name} of {GUIDE.name}) failed (exit {done.returncode}):\n"
                                 f"{(done.stdout + done.stderr)[-1500:]}")
            continue
        source, directory = copied
        if not source.is_file():
            built = ", ".join(sorted(p.name for p in source.parent.glob("*"))) or "nothing"
            raise GuideError(f"'{line}' (edgefl:{name} of {GUIDE.name}) copies {source.relative_to(PROJECT)}, "
                             f"but {source.parent.relative_to(PROJECT)}/ holds {built}: fix the guide's file name")
        target = root / directory.replace("~", home, 1).lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / source.name)
        echo(f"  [operator's machine] {line}  (no ssh to the check's root: copied into its {directory})")
        steps.append({"command": line, "ran": f"copied {source.relative_to(PROJECT)} into the root's {directory} "
                                              "(the check has no ssh to it)"})
    return steps
