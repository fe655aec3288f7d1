"""`broker-coordinator model list` and `model export`: the model versions of the state directory
and their export (storage/export.py does the work; torch is imported only to export)."""

from __future__ import annotations

from pathlib import Path

from broker_coordinator.settings.config import CoordinatorConfig
from broker_coordinator.storage.export import ModelVersion, export_model, find_version, model_versions


def list_models(config: CoordinatorConfig) -> int:
    state = config.storage.state_dir
    versions, problems = model_versions(state)
    rows = [("VERSION", "ROUND", "SCORE", "WEIGHTS", "")]
    rows += [(str(v.version), str(v.round), _score(v), "served average" if v.served else "last global",
              "current" if v.current else "") for v in reversed(versions)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"model {versions[-1].arch}, from {state}; 'broker-coordinator model export --version N OUT' writes one "
          "(the served average where kept; --last for the last global model)")
    for problem in problems:
        print(f"note: {problem}")
    return 0


def export(config: CoordinatorConfig, version: int | None, fmt: str, out: Path, last: bool, force: bool) -> int:
    done = export_model(config.storage.state_dir, version, out, fmt, last, force)
    m = done.metadata
    score = f"{m['metric']} {m['score']:.4g}" if m["score"] is not None else "no score"
    weights = "the served average" if m["weights"] == "served" else "the last global model"
    print(f"exported model version {m['version']} (round {m['round']}, {score}, {weights}) as {m['format']} to "
          f"{done.path} (sha256 {m['sha256'][:16]}...); its metadata in {Path(out) / 'metadata.json'}")
    return 0


def promote(config: CoordinatorConfig, version: int) -> int:
    from broker_coordinator.engine.serving import request_promote
    chosen = find_version(config.storage.state_dir, version)  # an unknown version: the error lists the kept ones
    request_promote(config.storage.state_dir, chosen.version)
    print(f"asked the coordinator to publish model version {chosen.version} (round {chosen.round}, {_score(chosen)}) "
          "for the devices to serve; a running coordinator does so within a second, a stopped one when it starts "
          "('broker-coordinator status' shows what is published)")
    return 0


def _score(v: ModelVersion) -> str:
    if v.score is None:
        return "-"
    return f"{v.metric} {v.score:.4g}" + (" (devices)" if v.scored_by == "devices" else "")
