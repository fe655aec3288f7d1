"""The layout shows the design: the import contracts of pyproject.toml hold (import-linter), no
package has an import circle, and no production module holds two ideas' worth of lines."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("broker_coordinator", "edge_agent", "edgefl_protocol", "edgefl_models")
MAX_LINES = 430  # "modules that grow past ~400 lines usually hold two ideas" (STYLE.md)


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "lint-imports is not installed: run `make setup` (import-linter is a dev extra)"
    result = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.parametrize("package", [*PRODUCTION, "bench"])
def test_no_import_circles(package):
    graph = grimp.build_graph(package, exclude_type_checking_imports=True)
    circles = sorted({tuple(sorted((a, b))) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                      if b.startswith(package) and graph.find_shortest_chain(importer=b, imported=a)})
    assert not circles, f"modules that import each other (directly or through others): {circles}"


def test_no_production_module_is_two_ideas_long():
    long = {str(p.relative_to(ROOT)): n for pkg in PRODUCTION for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"
