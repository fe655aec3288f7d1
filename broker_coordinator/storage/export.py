"""Model export: the versions a coordinator's state directory holds, written out as files an
application can load without EdgeFL (`broker-coordinator model list | export`, docs/OPERATOR.md,
"Exporting a model").

The versions are those of the current task: its live checkpoint (`checkpoint.msgpack`) and the
kept ones (`checkpoints/round-NNNNNN.msgpack`). A version holds two models when
`[evaluation] serve_average` > 0: the last global model and the served average, which is what the
coordinator evaluates and reports. The served one is exported unless `last` is asked for.

An export is a directory: the model file and `metadata.json` beside it:

    model.pt       format "state_dict": torch.save of the model's state_dict; load it into
                   edgefl_models.architectures.build_model(architecture), or the plug-in's factory
    model.ts       format "torchscript": the model traced with one sample of its input shape
    model.onnx     format "onnx": torch.onnx.export, the batch dimension dynamic (needs `onnx`)
    metadata.json  version, round, task, score and metric, architecture, input shape, label names,
                   the parameter fingerprint, the model file's sha256, which weights, the exporter

Reads only: safe beside a running coordinator. Imports torch when it exports.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from edgefl_protocol.persist import file_sha256
from edgefl_protocol.version import release
from typing import Any

from broker_coordinator.storage.store import CHECKPOINT, HISTORY_DIR, Checkpoint, StoreError, read_checkpoint
from broker_coordinator.storage.tasks import read_tasks
from edgefl_models.onnx_file import HINT as ONNX_HINT
from edgefl_models.onnx_file import available as onnx_available

FORMATS = {"state_dict": "model.pt", "torchscript": "model.ts", "onnx": "model.onnx"}
METADATA = "metadata.json"
DIGITS = [str(i) for i in range(10)]
# the built-in architectures whose classes have names: the digits 0-9 (MNIST, scikit-learn's digits)
LABEL_NAMES = {"mnist_cnn": DIGITS, "mnist_mlp": DIGITS, "digits_mlp": DIGITS}


@dataclass
class ModelVersion:
    """One exportable model version, as `model list` shows it."""
    version: int
    round: int
    arch: str
    current: bool  # the live checkpoint's
    path: Path  # the checkpoint file it is read from
    score: float | None
    metric: str | None
    scored_by: str | None  # "central" (the coordinator's test set), "devices" (federated), None: unscored
    served: bool  # the served average is kept (serve_average > 0), and exported by default


@dataclass
class Exported:
    path: Path  # the model file
    metadata: dict[str, Any]


def round_score(record: dict[str, Any]) -> tuple[float | None, str | None, str | None]:
    """(score, metric, by) of a checkpoint's round record: the central score, else the devices'."""
    central = record.get("score")
    if central is None or not math.isfinite(central):
        central = record.get("accuracy") if record.get("metric", "accuracy") == "accuracy" else None
    if central is not None and math.isfinite(central):
        return float(central), record.get("metric") or "accuracy", "central"
    federated = record.get("federated") or {}
    if federated.get("score") is not None and math.isfinite(federated["score"]):
        return float(federated["score"]), federated.get("metric") or "accuracy", "devices"
    return None, None, None


def _version_of(ckpt: Checkpoint, path: Path, current: bool) -> ModelVersion:
    score, metric, by = round_score(ckpt.record)
    return ModelVersion(ckpt.version, ckpt.round, ckpt.arch, current, path, score, metric, by,
                        ckpt.served is not None)


def model_versions(state_dir: Path | str) -> tuple[list[ModelVersion], list[str]]:
    """The current task's exportable versions, oldest first, and a note for each checkpoint file that
    could not be read. A version held by several checkpoints (rounds that only evaluated keep the
    model) is listed once: the live checkpoint's, else the newest round's."""
    state = Path(state_dir)
    live = state / CHECKPOINT
    if not live.exists():
        raise StoreError(f"no checkpoint in {state}: there is no model to export until the coordinator has "
                         "closed a round ('broker-coordinator run'), or [storage] state_dir names another directory")
    found: dict[int, ModelVersion] = {}
    problems: list[str] = []
    history = state / HISTORY_DIR
    kept = sorted(history.glob("round-*.msgpack")) if history.is_dir() else []
    for path, current in [(p, False) for p in kept] + [(live, True)]:
        try:
            entry = _version_of(read_checkpoint(path), path, current)
        except (ValueError, KeyError, OSError) as exc:
            problems.append(f"{path}: unreadable ({exc})")
            continue
        before = found.get(entry.version)
        if before is None or current or (not before.current and entry.round > before.round):
            found[entry.version] = entry
    return sorted(found.values(), key=lambda v: (v.version, v.round)), problems


def find_version(state_dir: Path | str, version: int | None) -> ModelVersion:
    """The version asked for (None: the current one), or an error listing the versions there are."""
    versions, problems = model_versions(state_dir)
    if version is None:
        current = next((v for v in versions if v.current), None)
        if current is None:
            raise StoreError(f"the live checkpoint cannot be read ({'; '.join(problems)}): name a kept version with "
                             f"--version ({', '.join(str(v.version) for v in versions) or 'none is kept'})")
        return current
    for v in versions:
        if v.version == version:
            return v
    available = ", ".join(f"{v.version}{' (current)' if v.current else ''}" for v in versions)
    raise StoreError(f"no model version {version} in {state_dir}: the versions it can export are {available} "
                     "('broker-coordinator model list' shows their rounds and scores; raise [storage] "
                     "keep_checkpoints to keep more)")


def check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise StoreError(f"{out} is a file: name a directory for the export")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise StoreError(f"{out} is not empty: name a new or empty directory, or add --force to write over "
                         "the model and metadata.json in it")


def export_model(state_dir: Path | str, version: int | None, out: Path | str, fmt: str = "state_dict",
                 last: bool = False, force: bool = False) -> Exported:
    """Write version `version` (None: the current one) of the state directory's model into `out`."""
    out = Path(out)
    if fmt not in FORMATS:
        raise StoreError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "onnx" and not onnx_available():
        raise StoreError(ONNX_HINT)
    check_target(out, force)
    chosen = find_version(state_dir, version)
    ckpt = read_checkpoint(chosen.path)
    which = "served" if ckpt.served is not None and not last else "last"
    weights = ckpt.served if which == "served" else ckpt.weights

    import torch  # only now: `model list` and the refusals above stay quick
    from edgefl_models.architectures import ModelError, build_model, fingerprint, resolve, set_weights
    try:
        arch = resolve(ckpt.arch)
        model = build_model(ckpt.arch)
        set_weights(model, weights)
    except (ModelError, KeyError, RuntimeError) as exc:
        raise StoreError(f"version {chosen.version} cannot be rebuilt as model {ckpt.arch!r} here: {exc}") from None
    model.eval()
    sample = torch.zeros((1, *arch.input_shape))

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*FORMATS.values(), METADATA]:  # with --force: no file of an earlier export stays beside
        (out / stale).unlink(missing_ok=True)
    target = out / FORMATS[fmt]
    partial = out / f".{target.name}.partial"
    _write_model(model, fmt, sample, partial)
    _fsync(partial)
    os.replace(partial, target)

    metadata = _metadata(state_dir, chosen, ckpt, which, fmt, target, arch, fingerprint(model), model)
    text = json.dumps(metadata, indent=2) + "\n"
    partial = out / f".{METADATA}.partial"
    partial.write_text(text)
    _fsync(partial)
    os.replace(partial, out / METADATA)
    return Exported(target, metadata)


def _write_model(model: Any, fmt: str, sample: Any, path: Path) -> None:
    import warnings

    import torch

    from edgefl_models.onnx_file import OnnxUnavailable, write_onnx
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notes on jit and the ONNX exporter
        if fmt == "state_dict":
            torch.save({name: t.contiguous() for name, t in model.state_dict().items()}, path)
        elif fmt == "torchscript":
            torch.jit.trace(model, sample).save(str(path))
        else:
            try:
                write_onnx(model, tuple(sample.shape[1:]), path)
            except OnnxUnavailable as exc:
                raise StoreError(f"{exc}; export --format state_dict or torchscript instead") from None


def _metadata(state_dir: Path | str, chosen: ModelVersion, ckpt: Checkpoint, which: str, fmt: str, target: Path,
              arch: Any, model_fingerprint: str, model: Any) -> dict[str, Any]:
    import torch
    task = next((t.id for t in read_tasks(state_dir) if t.current), None)
    return {
        "version": chosen.version,
        "round": chosen.round,
        "task": task,
        "current": chosen.current,
        "score": chosen.score,
        "metric": chosen.metric,
        "scored_by": chosen.scored_by,
        "weights": which,  # "served": the served average the coordinator evaluates; "last": the last global model
        "format": fmt,
        "file": target.name,
        "sha256": file_sha256(target),
        "architecture": ckpt.arch,
        "plugin": ":" in ckpt.arch,  # a package.module:factory of the user's, installed where it is loaded
        "input_shape": list(arch.input_shape),
        "outputs": arch.num_classes,
        "label_names": label_names(ckpt.arch, model, arch.num_classes),
        "fingerprint": model_fingerprint,
        "model_sha256": ckpt.sha256 if which == "last" else None,  # the global model's, as the round record has it
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "exporter": {"package": "edgefl", "version": release(), "torch": torch.__version__},
    }


def label_names(arch_name: str, model: Any, outputs: int) -> list[str] | None:
    """The classes' names where they are known: the built-in digit models', or a plug-in module's
    `label_names` attribute (one name per output)."""
    names = LABEL_NAMES.get(arch_name) or getattr(model, "label_names", None)
    if isinstance(names, (list, tuple)) and len(names) == outputs and all(isinstance(n, str) for n in names):
        return list(names)
    return None


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())

