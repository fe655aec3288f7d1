"""The device's serving store: the models its own applications use, one immutable directory per version.

    <dir>/
      7/ model.pt  model.onnx  metadata.json
      8/ model.pt  model.onnx  metadata.json
      current -> 8

Published the way Triton and OpenVINO publish model versions: a version is written into a temporary
directory, fsynced and renamed into place (a rename onto an existing version fails, so a published
version never changes), then made current by creating a new symlink under a temporary name and
`os.replace`-ing it over `current`. A reader that resolves `current` once and reads that directory
sees one complete version (`serving.ServedModel`). The last `keep` versions stay (the current one
always); older ones are removed.

`model.pt` is a torch state_dict (`torch.load(..., weights_only=True)`); `model.onnx`, where the
`onnx` package is installed on the device and the architecture exports, the same model for any
language (input "input", output "output", a dynamic batch dimension); `metadata.json` holds the
version, round, architecture, fingerprint, sha256 of model.pt (and of model.onnx, or null), when it
was published, and the device's own score of it on its held-out data (null when it had none).
"""

from __future__ import annotations

import grp
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("edge_agent.serving")
CURRENT = "current"
WEIGHTS = "model.pt"
ONNX = "model.onnx"
METADATA = "metadata.json"
DIR_MODE, FILE_MODE = 0o750, 0o640  # the owner writes, the store's group reads, nobody else
_VERSION = re.compile(r"^[0-9]+$")


class StoreError(Exception):
    """The store cannot be read or written, with what to do about it."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ServingStore:
    """The store at `root`; `keep` versions kept; files readable by local `group` when it exists."""

    def __init__(self, root: Path | str, keep: int = 3, group: str = "") -> None:
        self.root, self.keep = Path(root), keep
        self.gid = self._group_id(group)
        self._said_no_onnx = False

    @staticmethod
    def _group_id(group: str) -> int | None:
        if not group:
            return None
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            log.info("serving store: group %r does not exist: only the agent's user reads the store "
                     "(create it with 'sudo groupadd %s')", group, group)
            return None

    # reading ----------------------------------------------------------------------
    def current_version(self) -> int | None:
        try:
            target = os.readlink(self.root / CURRENT)
        except OSError:
            return None
        return int(target) if _VERSION.match(target) else None

    def versions(self) -> list[int]:
        """The published versions, oldest first."""
        try:
            names = [p.name for p in self.root.iterdir() if p.is_dir() and not p.is_symlink()]
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if _VERSION.match(n))

    def has(self, version: int) -> bool:
        return (self.root / str(version)).is_dir()

    def metadata(self, version: int) -> dict[str, Any]:
        return json.loads((self.root / str(version) / METADATA).read_text())

    # writing ----------------------------------------------------------------------
    def publish(self, version: int, state_dict: dict, metadata: dict[str, Any],
                onnx_of: tuple[Any, tuple[int, ...]] | None = None) -> Path:
        """Write `version` (a state_dict and its metadata; with `onnx_of`, (the module, its input shape),
        model.onnx too where this machine can) and make it current. A version already published is
        never rewritten: StoreError."""
        import torch
        final = self.root / str(version)
        if final.exists():
            raise StoreError(f"version {version} is already in {self.root}; a published version never changes")
        self._make_root()
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        body = buffer.getvalue()
        meta = {**metadata, "version": version, "sha256": hashlib.sha256(body).hexdigest(),
                "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "onnx_sha256": None}
        staging = Path(tempfile.mkdtemp(prefix=f".{version}.", suffix=".tmp", dir=self.root))
        try:
            self._write(staging / WEIGHTS, body)
            if onnx_of is not None:
                meta["onnx_sha256"] = self._write_onnx(staging / ONNX, *onnx_of)
            self._write(staging / METADATA, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
            self._own(staging, DIR_MODE)
            _fsync_dir(staging)
            os.rename(staging, final)  # fails when `final` appeared meanwhile: never replaces a version
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _fsync_dir(self.root)
        self.make_current(version)
        self.prune()
        return final

    def _write_onnx(self, path: Path, model: Any, input_shape: tuple[int, ...]) -> str | None:
        """model.onnx beside model.pt, or None (said once at INFO): no onnx package, or an architecture
        the exporter does not know."""
        from edgefl_models.onnx_file import OnnxUnavailable, write_onnx
        try:
            write_onnx(model, input_shape, path)
        except OnnxUnavailable as exc:
            if not self._said_no_onnx:
                self._said_no_onnx = True
                log.info("serving store: no model.onnx beside model.pt (%s)", exc)
            return None
        with open(path, "rb") as handle:  # as the store's other files: its mode and group, on disk
            self._own_fd(handle.fileno(), FILE_MODE)
            os.fsync(handle.fileno())
            return hashlib.sha256(handle.read()).hexdigest()

    def make_current(self, version: int) -> None:
        """Point `current` at a published version in one atomic step."""
        if not self.has(version):
            raise StoreError(f"version {version} is not in {self.root}")
        link = self.root / f".{CURRENT}.{os.getpid()}.{time.monotonic_ns()}"
        os.symlink(str(version), link)  # relative: the store may move
        try:
            os.replace(link, self.root / CURRENT)
        except BaseException:
            link.unlink(missing_ok=True)
            raise
        _fsync_dir(self.root)

    def prune(self) -> list[int]:
        """Remove all but the newest `keep` versions, never the current one; and leftovers of a crash."""
        current = self.current_version()
        versions = self.versions()
        doomed = [v for v in versions[:max(len(versions) - self.keep, 0)] if v != current]
        for version in doomed:
            # renamed away first: a reader sees the version whole or not at all (and then reads `current` again)
            trash = self.root / f".{version}.{time.monotonic_ns()}.old"
            os.rename(self.root / str(version), trash)
            shutil.rmtree(trash, ignore_errors=True)
        for leftover in self.root.glob(".*.tmp"):
            if leftover.is_dir() and time.time() - leftover.stat().st_mtime > 3600:  # not a writer at work now
                shutil.rmtree(leftover, ignore_errors=True)
        return doomed

    def _make_root(self) -> None:
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            self._own(self.root, DIR_MODE)

    def _write(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as handle:
            self._own_fd(handle.fileno(), FILE_MODE)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def _own(self, path: Path, mode: int) -> None:
        os.chmod(path, mode)
        if self.gid is not None:
            os.chown(path, -1, self.gid)

    def _own_fd(self, fd: int, mode: int) -> None:
        os.fchmod(fd, mode)
        if self.gid is not None:
            os.fchown(fd, -1, self.gid)
