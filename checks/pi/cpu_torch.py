"""Refuse a CUDA build of torch before pip downloads it (used by `make setup`).

Reads the JSON of `pip install --dry-run --report FILE torch==...` and exits 1,
saying what to do, when the resolved install would bring NVIDIA's libraries:
what PyPI serves for a plain `torch` on Linux when PyTorch's CPU-only index
(https://download.pytorch.org/whl/cpu) cannot be reached.
"""

from __future__ import annotations

import json
import sys


def cuda_packages(report: dict) -> list[str]:
    names = [item["metadata"]["name"] for item in report.get("install", [])]
    return [name for name in names if name.lower().startswith(("nvidia-", "triton"))]


def main(argv: list[str]) -> int:
    report_path, spec = argv[1], argv[2]
    with open(report_path) as handle:
        report = json.load(handle)
    torch = [item for item in report.get("install", []) if item["metadata"]["name"].lower() == "torch"]
    cuda = cuda_packages(report)
    if not cuda:
        chosen = torch[0]["metadata"]["version"] if torch else "already installed"
        print(f"torch: CPU-only build ({chosen})")
        return 0
    print(f"error: '{spec}' resolves to a CUDA build of torch here (it would bring {', '.join(cuda[:3])}, ...: "
          "several GB).", file=sys.stderr)
    print("PyTorch's CPU-only index was not reachable. Either make it reachable and run make again, or install a "
          "CPU wheel you have as a file: make TORCH_SPEC=/path/to/torch-...+cpu-....whl, or use the "
          "distribution's build: sudo apt-get install --no-install-recommends python3-torch && make TORCH=system",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
