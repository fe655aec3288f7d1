"""`make setup` refuses a CUDA build of torch before downloading it (checks/pi/cpu_torch.py reads pip's dry-run report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _report(tmp_path: Path, names: list[tuple[str, str]]) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": v}} for n, v in names]}))
    return path


def _check(report: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "checks/pi/cpu_torch.py"), str(report), "torch==2.13.0"],
                          capture_output=True, text=True)


def test_a_cpu_wheel_passes(tmp_path):
    done = _check(_report(tmp_path, [("torch", "2.13.0+cpu"), ("sympy", "1.14.0")]))
    assert done.returncode == 0 and "CPU-only build (2.13.0+cpu)" in done.stdout


def test_a_cuda_build_is_refused_with_what_to_do(tmp_path):
    # what PyPI's plain torch resolves to on Linux x86 when PyTorch's CPU index is unreachable
    done = _check(_report(tmp_path, [("torch", "2.13.0"), ("nvidia-cudnn-cu13", "9.1"), ("triton", "3.5")]))
    assert done.returncode == 1
    assert "CUDA build" in done.stderr and "TORCH_SPEC=" in done.stderr and "python3-torch" in done.stderr
