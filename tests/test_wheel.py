"""The wheel installs only EdgeFL's own top-level names: beside a user's own `models` package (a name
many projects use), both import as they should."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .operator_fixtures import PROJECT_ROOT

OURS = {"broker_coordinator", "edge_agent", "edgefl_protocol", "edgefl_models"}


def source_copy(into: Path) -> Path:
    """What the wheel is built from, copied: setuptools writes build/ and *.egg-info beside its sources, and a
    test leaves the checkout as it found it."""
    into.mkdir(parents=True)
    names = ["pyproject.toml", "README.md", "systemd", *sorted(OURS)]
    for name in names:
        source = PROJECT_ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, into / name)
    return into


def test_the_wheel_holds_only_edgefl_names_and_leaves_a_users_models_package_alone(tmp_path):
    source = source_copy(tmp_path / "source")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "--wheel-dir", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("edgefl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist()}
    packages = {name for name in top if not name.endswith((".dist-info", ".data"))}
    assert packages == OURS, packages

    installed = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(installed),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    user = tmp_path / "app"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("OWNER = 'the user'\n")
    probe = ("import models, edgefl_models.architectures as a; "
             "print(models.OWNER, a.__file__.startswith(%r), tuple(a.resolve('digits_mlp').input_shape) == (64,))" % str(installed))
    ran = subprocess.run([sys.executable, "-c", probe], cwd=user, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": f"{user}:{installed}", "PATH": "/usr/bin:/bin"})
    assert ran.returncode == 0 and ran.stdout.split() == ["the", "user", "True", "True"], ran.stdout + ran.stderr


def test_no_module_of_the_project_imports_a_bare_models_package():
    offenders = [str(p.relative_to(PROJECT_ROOT)) for pkg in sorted(OURS) for p in (PROJECT_ROOT / pkg).rglob("*.py")
                 if any(line.startswith(("from models", "import models")) for line in p.read_text().splitlines())]
    assert offenders == [], offenders
