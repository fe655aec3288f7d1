"""`make pi-dp-sgd`: what sample-level DP-SGD (`[privacy] device = "dp-sgd"`) costs on an emulated Pi.

In the arm64 root that `make pi-check` installed as docs/OPERATOR.md says (PyPI's aarch64 torch,
cached in /var/cache/edgefl-pi-root), the device extra is added as an operator would add it
(`pip install opacus`, the version this host runs), then, for each of pi4 (QEMU_CPU=cortex-a72)
and pi5 (cortex-a76), one device's local round of each model (FedAvg, one epoch over 250 samples,
batch 32, one thread; z 1.0, C 1.0: what `make dp-sgd-cost` runs on this host) with and without
DP-SGD, alternating, in a fresh emulated process each (checks/pi/train_probe.py local-round).

What it measures: that DP-SGD runs on aarch64 with the torch the guide installs, the guest's
peak RSS with and without it, and the ratio of training seconds. Emulation is about 90x slower
than a real Pi and does not slow every instruction alike, so the seconds are not a Pi's and the
ratio is emulation's; `make dp-sgd-cost` gives the ratio under a Pi 4's CPU quota on x86.
Writes bench/results/pi_dp_sgd.json and .md; logs to CACHE/logs/dp-sgd.log.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import provenance
from bench.dp_sgd_cost import DECIDING, alternating, timings

from . import root as pi_root
from .pi_check import GUEST_PYTHON, PIS, PROJECT, README_CANDIDATE, RESULTS, measured

MODELS = ["mnist_cnn", "digits_mlp"]
GUEST_WORK = "/tmp/pi-dp-sgd"


def install_opacus(root: Path, cpu: str, log: Path, echo) -> str:
    """The device extra in the guide's venv: the Opacus version this host runs (the tests' one)."""
    version = importlib.metadata.version("opacus")
    command = [GUEST_PYTHON, "-m", "pip", "install", "--quiet", f"opacus=={version}"]
    echo(f"  [{cpu}] {' '.join(command)}")
    done = pi_root.run_guest(root, cpu, command, timeout=3 * 3600)
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(command)}\n{done.stdout}\n")
    if done.returncode != 0:
        raise pi_root.SetupError(f"installing opacus {version} in the Pi root failed (exit {done.returncode}); "
                                 f"see {log}:\n{done.stdout[-2000:]}")
    return version


def one_run(root: Path, cpu: str, model: str, private: bool, log: Path) -> dict:
    out = f"{GUEST_WORK}/{model}-{cpu}-{int(private)}.json"
    argv = [GUEST_PYTHON, f"{GUEST_WORK}/train_probe.py", "local-round", f"{GUEST_WORK}/{model}.npz", out,
            "--threads", "1"] + (["--dp"] if private else [])
    code, output, memory = measured(root, cpu, argv, log)
    result_path = root / out.lstrip("/")
    if code != 0 or not result_path.exists():
        raise pi_root.SetupError(f"{model} local round ({'DP-SGD' if private else 'plain'}) failed under {cpu} "
                                 f"(exit {code}); see {log}:\n{output[-1500:]}")
    return {**json.loads(result_path.read_text()), "memory": memory}


def summarize(runs: dict[str, list[dict]]) -> dict:
    row = {k: round(v, 2 if k != "opacus_import_seconds" else 1) for k, v in timings(runs).items()}
    return {**row, "plain_guest_rss_mb": max(r["memory"]["guest_mb"] for r in runs["plain"]),
            "dp_sgd_guest_rss_mb": max(r["memory"]["guest_mb"] for r in runs["dp_sgd"]),
            "private_rounds_ran_dp_sgd": all(r.get("dp_sgd_ran") for r in runs["dp_sgd"])
            and not any(r.get("dp_sgd_ran") for r in runs["plain"]), "runs": runs}


def markdown(result: dict) -> str:
    with_ = result["measured_with"]
    lines = ["# DP-SGD on an emulated Pi (`make pi-dp-sgd`)", "",
             f"`{with_['command']}` on commit {with_.get('commit')}, {result['measured']}: qemu-user aarch64 emulation "
             f"of the guide's Pi install (torch {result['torch']}) plus opacus {result['opacus']}; FedAvg, one epoch of "
             "250 samples, batch 32, one thread, z 1.0, C 1.0; medians of "
             f"{with_['repeats']} alternating runs, each a fresh process.", "",
             "Emulation is about 90x slower than a real Pi and does not slow every instruction alike: the seconds "
             "are not a Pi's. `make dp-sgd-cost` (bench/results/dp_sgd_cost.md) gives the ratio under a Pi 4's CPU "
             "quota on x86. Guest RSS: the emulated process's own mappings (checks/pi/memory.py).", "",
             "| Pi | model | plain s | DP-SGD s | ratio | Opacus import s | guest RSS plain / DP-SGD MB | "
             "DP-SGD ran (and only there) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for pi, models in result["pis"].items():
        for model, r in models.items():
            lines.append(f"| {pi} | {model} | {r['plain_seconds']:.2f} | {r['dp_sgd_seconds']:.2f} | {r['ratio']:.2f}x | "
                         f"{r['opacus_import_seconds']:.1f} | {r['plain_guest_rss_mb']:.0f} / "
                         f"{r['dp_sgd_guest_rss_mb']:.0f} | {r['private_rounds_ran_dp_sgd']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("PI_ROOT_CACHE", "/var/cache/edgefl-pi-root")))
    parser.add_argument("--pis", default="pi4,pi5")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` unmounts the root's /proc, /dev, /sys
    echo = lambda line: print(line, flush=True)  # noqa: E731
    root = args.cache / f"pi-{README_CANDIDATE}"
    try:
        pi_root.preflight()
        if not (root / ".edgefl-installed.json").exists():
            raise pi_root.SetupError(f"no installed Pi root in {root}: run 'make pi-check' (or "
                                     "'make pi-check PI_CHECK_ARGS=--install-only') first")
        result = run(args, root, echo)
    except pi_root.SetupError as exc:
        print(f"pi-dp-sgd: {exc}", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pi_dp_sgd.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "pi_dp_sgd.md").write_text(markdown(result))
    print((RESULTS / "pi_dp_sgd.md").read_text())
    return 0


def run(args: argparse.Namespace, root: Path, echo) -> dict:
    log = args.cache / "logs" / "dp-sgd.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    pis = args.pis.split(",")
    work = root / GUEST_WORK.lstrip("/")
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy2(PROJECT / "checks/pi/train_probe.py", work / "train_probe.py")
    for model in MODELS:
        subprocess.run([sys.executable, str(PROJECT / "checks/pi/train_probe.py"), "make-inputs", model,
                        str(work / f"{model}.npz")], check=True, cwd=PROJECT)
    result: dict = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "pis": {},
                    "measured_with": provenance.measured_with(provenance.invoked(), DECIDING, repeats=args.repeats, pis=pis,
                        emulation="qemu-user-static (Debian bookworm) via binfmt, chroot")}
    with pi_root.mounted(root):
        result["opacus"] = install_opacus(root, PIS[pis[0]], log, echo)
        for pi in pis:
            cpu = PIS[pi]
            result["pis"][pi] = {}
            for model in MODELS:
                runs = alternating(args.repeats, lambda private: one_run(root, cpu, model, private, log))
                row = result["pis"][pi][model] = summarize(runs)
                result["torch"] = runs["plain"][0]["torch"]
                echo(f"{pi} {model}: {row['plain_seconds']:.2f} s plain, {row['dp_sgd_seconds']:.2f} s with DP-SGD "
                     f"({row['ratio']:.2f}x); guest RSS {row['plain_guest_rss_mb']:.0f} / {row['dp_sgd_guest_rss_mb']:.0f} MB")
    return result


if __name__ == "__main__":
    sys.exit(main())
