"""Applications use the device's model: `ServedModel` always gives the store's current version.

    from edge_agent.serving import ServedModel
    served = ServedModel("/var/lib/edgefl-serving")
    classes = served.predict(x)        # x: a batch, numpy or torch, of the model's input shape
    served.metadata["version"]         # the version that answered

Each call checks the `current` link (one readlink) and loads the version it points at when it
changed. A version is read from its own directory, which never changes once published, and its
model.pt is checked against the sha256 in its metadata.json; a version removed while being read is
read again from `current` (see `serving_store`).

An application in another process, or one that should not load torch, asks `edge-agent serve` over
its Unix socket instead: `predict_over_socket(path, x)` (the protocol: `edge_agent.serve`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgefl_models.architectures import build_model, fingerprint

from .serving_store import CURRENT, METADATA, WEIGHTS, StoreError

READ_ATTEMPTS = 5  # a version pruned between readlink and read: try `current` again


def read_current(root: Path | str) -> tuple[str, dict[str, Any], bytes]:
    """(the link's target, metadata, model.pt bytes) of the current version, consistent with each other."""
    root = Path(root)
    for _ in range(READ_ATTEMPTS):
        try:
            target = os.readlink(root / CURRENT)
        except FileNotFoundError:
            raise StoreError(f"{root} holds no current model yet: the agent publishes one after its first "
                             "round (is [serving] dir this directory?)") from None
        except OSError as exc:
            raise StoreError(f"cannot read {root / CURRENT}: {exc} (is this user in the store's group?)") from None
        try:
            meta = json.loads((root / target / METADATA).read_text())
            body = (root / target / WEIGHTS).read_bytes()
        except FileNotFoundError:
            continue  # pruned under us: `current` now names a newer one
        if hashlib.sha256(body).hexdigest() != meta.get("sha256"):
            raise StoreError(f"{root / target / WEIGHTS} does not match the sha256 in its metadata.json: the "
                             "store was changed by hand; remove that version and restart the agent")
        return target, meta, body
    raise StoreError(f"{root}: the current version kept disappearing while being read")


def load_model(meta: dict[str, Any], body: bytes) -> torch.nn.Module:
    """The model a version's files describe, in eval mode."""
    model = build_model(meta["architecture"])
    if meta.get("fingerprint") and fingerprint(model) != meta["fingerprint"]:
        raise StoreError(f"the installed {meta['architecture']} differs from the one version {meta['version']} "
                         "was trained as: install the model's package in the version the agent uses")
    model.load_state_dict(torch.load(io.BytesIO(body), weights_only=True))
    return model.eval()


class ServedModel:
    """The current model of the serving store at `path`, reloaded when the `current` link changes."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._target: str | None = None
        self._meta: dict[str, Any] = {}
        self._model: torch.nn.Module | None = None

    def _refresh(self) -> torch.nn.Module:
        with self._lock:
            try:
                target = os.readlink(self.path / CURRENT)
            except OSError:
                target = None
            if self._model is None or target != self._target:
                self._target, self._meta, body = read_current(self.path)
                self._model = load_model(self._meta, body)
            return self._model

    def model(self) -> torch.nn.Module:
        """The current version's torch module (eval mode); do not train it in place."""
        return self._refresh()

    def current(self) -> tuple[torch.nn.Module, dict[str, Any]]:
        """(module, metadata) of one version, read together: what a multi-threaded caller uses so that
        the version it names is the one that answered."""
        with self._lock:
            model = self._refresh()
            return model, dict(self._meta)

    @property
    def metadata(self) -> dict[str, Any]:
        """The current version's metadata.json."""
        self._refresh()
        return dict(self._meta)

    def predict(self, x: np.ndarray | torch.Tensor) -> np.ndarray:
        """Predicted classes (classification) or values (regression) for a batch `x`."""
        model, meta = self.current()
        task = meta.get("task", "classification")
        inputs = torch.as_tensor(np.asarray(x, dtype=np.float32) if not isinstance(x, torch.Tensor) else x)
        with torch.no_grad():
            output = model(inputs.float())
        if task == "classification":
            return output.argmax(dim=1).numpy()
        values = output.reshape(len(inputs), -1)
        return (values[:, 0] if values.shape[1] == 1 else values).numpy()


class ServeError(RuntimeError):
    """`edge-agent serve` answered with an error (its one-line message), or could not be reached."""


def predict_over_socket(path: Path | str, x: Any, probabilities: bool = False,
                        timeout: float = 30.0) -> dict[str, Any]:
    """Ask the `edge-agent serve` listening on the Unix socket `path` for predictions of `x` (a batch, or
    one sample, of the model's input shape; numpy, torch or nested lists). Returns its answer,
    `{"version": N, "predictions": [...]}` (and `"probabilities"` when asked); raises ServeError with
    the server's message when it answers an error."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    request: dict[str, Any] = {"x": x}
    if probabilities:
        request["probabilities"] = True
    return _ask(path, request, timeout)


def _ask(path: Path | str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(str(path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            with conn.makefile("rb") as answers:
                line = answers.readline()
    except OSError as exc:
        raise ServeError(f"cannot reach edge-agent serve at {path}: {exc} (is it running, and is this user in "
                         "the socket's group?)") from None
    if not line:
        raise ServeError(f"edge-agent serve at {path} closed the connection without an answer")
    answer = json.loads(line)
    if "error" in answer:
        raise ServeError(answer["error"])
    return answer
