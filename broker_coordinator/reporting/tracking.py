"""Runs tracked where researchers look: each round's record to TensorBoard and/or MLflow
(`[tracking]`, `broker_coordinator/settings/tracking_settings.py`), from `run` and `simulate`.

Per round (the step is the round number; in buffered mode the version's):
    global/<metric>, global/loss            the central evaluation (the served model)
    global/<metric>_devices, global/loss_devices    the devices' sample-weighted evaluation
    global/<metric>_ahead                   delta downlink: the server rule's G, ahead of what devices hold
    round/participants, round/selected, round/bytes_up, round/bytes_down, round/seconds, round/rejected
    round/bounded, round/left_out           accepted updates the fold bounded (norm, centre, weight) or
                                            left out (direction); bounded/<how> per kind
    privacy/epsilon                         when the record carries one (`epsilon`, or `privacy.epsilon`)
    device/<id>/<key>                       every numeric value of the round's per-device metrics
The whole configuration goes in as the run's parameters (MLflow params; TensorBoard text), and at the
end the plot of the metric per round (report.metric_figure) as an artifact, with any files given.

Writing happens on a thread of its own, behind a bounded queue: a tracker that is slow, full or down
never holds up a round. A failed write is logged and counted (`failures`, and the Prometheus counter
edgefl_tracking_failures by sink), and the next round is written as usual.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from broker_coordinator.settings.tracking_settings import EXTRA, TrackingSettings

log = logging.getLogger("broker_coordinator.tracking")
QUEUE = 512  # rounds waiting to be written before new ones are dropped (and counted)
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest parameter value
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./ :]")  # characters MLflow refuses in metric and param keys


class TrackingUnavailable(ValueError):
    """A tracker was asked for and its package is missing; the message says what to install."""


def round_values(record: Mapping[str, Any] | Any) -> dict[str, float]:
    """The scalars of one round record (a RoundRecord or its dict), named as the module docstring says."""
    rec = asdict(record) if is_dataclass(record) else dict(record)
    metric = rec.get("metric") or "accuracy"
    out: dict[str, float] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[_UNSAFE.sub("_", key)] = float(value)

    put(f"global/{metric}", rec.get("score", rec.get("accuracy")))
    put("global/loss", rec.get("loss"))
    federated = rec.get("federated") or {}
    if isinstance(federated, Mapping):
        put(f"global/{metric}_devices", federated.get("score"))
        put("global/loss_devices", federated.get("loss"))
    put(f"global/{metric}_ahead", rec.get("global_score"))
    for key in ("participants", "selected", "bytes_up", "bytes_down", "seconds"):
        put(f"round/{key}", rec.get(key))
    put("round/rejected", sum((rec.get("rejected") or {}).values()))
    clipped = rec.get("clipped") or {}
    put("round/bounded", sum(n for how, n in clipped.items() if how != "direction"))
    put("round/left_out", clipped.get("direction", 0))
    for how, n in clipped.items():
        put(f"bounded/{how}", n)
    privacy = rec.get("privacy")
    put("privacy/epsilon", rec.get("epsilon", privacy.get("epsilon") if isinstance(privacy, Mapping) else None))
    for device, metrics in (rec.get("devices") or {}).items():
        for key, value in (metrics or {}).items():
            put(f"device/{device}/{key}", value)
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as run parameters: {"rounds.lr": "0.05", ...}. Secrets are left out."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if str(key).lower().endswith(("password", "secret", "signing_key")):
            continue
        if is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[_UNSAFE.sub("_", name)] = str(value)[:MLFLOW_PARAM_CHARS]
    return out


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, directory: str, run_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrackingUnavailable(f"[tracking] tensorboard needs the tensorboard package ({exc}): {EXTRA}") from None
        self._writer_class, self.log_dir = SummaryWriter, Path(directory) / run_name
        self.writer: Any = None

    def open(self, params: Mapping[str, str]) -> None:
        self.writer = self._writer_class(log_dir=str(self.log_dir))
        table = "\n".join(["| key | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in sorted(params.items()))])
        self.writer.add_text("configuration", table, 0)
        self.writer.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def figure(self, figure: Any, png: Path | None, step: int) -> None:
        self.writer.add_figure("plot", figure, step, close=False)

    def files(self, paths: Iterable[Path]) -> None:
        pass  # TensorBoard has no place for files; the plot went in as a figure

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class MlflowSink:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode behind this switch; mlflow-skinny brings
            # no database backend, and a file: URI says the file store is what the operator wants
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise TrackingUnavailable(f"[tracking] mlflow needs the mlflow-skinny package ({exc}): {EXTRA}") from None
        self._client_class, self._metric, self._param = MlflowClient, Metric, Param
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.client: Any = None
        self.run_id = ""

    def open(self, params: Mapping[str, str]) -> None:
        client = self._client_class(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
        run = client.create_run(experiment_id, run_name=self.run_name, tags={"edgefl": "coordinator"})
        items = [self._param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=items[i:i + 100])
        self.client, self.run_id = client, run.info.run_id

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        items = [self._metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(items), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def figure(self, figure: Any, png: Path | None, step: int) -> None:
        if png is not None:
            self.client.log_artifact(self.run_id, str(png))

    def files(self, paths: Iterable[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class RunTracker:
    """The configured sinks, fed from a queue by one writer thread."""

    def __init__(self, sinks: list[Any], params: Mapping[str, Any], metrics: Any = None) -> None:
        self.sinks = sinks
        self.params = flatten(params)
        self.metrics = metrics  # reporting.metrics.Metrics, for edgefl_tracking_failures
        self.failures: Counter[str] = Counter()
        self.opened: set[str] = set()
        self.rounds: list[dict[str, Any]] = []  # what the plot needs, one small dict per round
        self.last_step = 0
        self.queue: queue.Queue[Callable[[], None] | None] = queue.Queue(QUEUE)
        self.thread = threading.Thread(target=self._work, name="edgefl-tracking", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, settings: TrackingSettings | None, federation: str, params: Mapping[str, Any],
              metrics: Any = None) -> RunTracker | None:
        """The tracker `settings` ask for (None when they ask for none). Raises TrackingUnavailable
        (naming the package to install) before anything runs."""
        if settings is None or not settings.enabled:
            return None
        run_name = settings.run_name or f"{federation}-{time.strftime('%Y%m%d-%H%M%S')}"
        sinks: list[Any] = []
        if settings.tensorboard:
            sinks.append(TensorBoardSink(settings.tensorboard, run_name))
        if settings.mlflow:
            sinks.append(MlflowSink(settings.mlflow, settings.experiment or federation, run_name))
        tracker = cls(sinks, params, metrics)
        log.info("tracking run %s: %s", run_name, tracker.describe())
        return tracker

    def describe(self) -> str:
        """Where the run goes, e.g. "TensorBoard DIR/RUN, MLflow file:/x (experiment 'sim', run RUN)"."""
        return ", ".join(f"TensorBoard {s.log_dir}" if s.name == "tensorboard" else
                         f"MLflow {s.uri} (experiment {s.experiment!r}, run {s.run_name!r})" for s in self.sinks)

    def round(self, record: Mapping[str, Any] | Any) -> None:
        """Queue one round's record for every sink (never blocks: a full queue drops it, counted)."""
        rec = asdict(record) if is_dataclass(record) else dict(record)
        step = int(rec.get("round", self.last_step + 1))
        self.last_step = step
        values = round_values(rec)
        self.rounds.append({k: rec.get(k) for k in ("round", "metric", "score", "accuracy", "federated", "kind")})
        for sink in self.sinks:
            self._put(sink, lambda sink=sink: sink.scalars(step, values))

    def finish(self, files: Iterable[Path] = (), title: str = "", failed: bool = False,
               timeout: float = 60.0) -> None:
        """The plot and `files` as artifacts, the run closed; waits up to `timeout` s for the writer."""
        files = [Path(f) for f in files if Path(f).exists()]
        for sink in self.sinks:
            self._put(sink, lambda sink=sink: self._plot(sink, title))
            self._put(sink, lambda sink=sink: sink.files(files))
            self._put(sink, lambda sink=sink: sink.close(failed))
        self.queue.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("tracking: the writer did not finish within %.0f s; the run's last writes may be missing",
                        timeout)
        if self.failures:
            log.warning("tracking: %s failed writes (see the warnings above)",
                        ", ".join(f"{sink} {n}" for sink, n in sorted(self.failures.items())))

    # the writer thread ----------------------------------------------------------------
    def _put(self, sink: Any, job: Callable[[], None]) -> None:
        def run() -> None:
            if sink.name not in self.opened:  # opened lazily, and again after a failed open
                sink.open(self.params)
                self.opened.add(sink.name)
            job()
        run.sink = sink.name  # type: ignore[attr-defined]
        try:
            self.queue.put_nowait(run)
        except queue.Full:
            self._failed(sink.name, "its queue is full (the tracker is slower than the rounds); dropped")

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must never stop a round
                self._failed(getattr(job, "sink", "?"), f"{type(exc).__name__}: {exc}")

    def _failed(self, sink: str, why: str) -> None:
        self.failures[sink] += 1
        if self.metrics is not None:
            self.metrics.tracking_failures.labels(sink).inc()
        log.warning("tracking: a write to %s failed (%s); the rounds go on", sink, why[:300])

    def _plot(self, sink: Any, title: str) -> None:
        from broker_coordinator.reporting.report import metric_figure
        figure = metric_figure(self.rounds, title) if self.rounds else None
        if figure is None:
            return  # no rounds, or matplotlib is not installed
        metric = self.rounds[0].get("metric") or "accuracy"
        with tempfile.TemporaryDirectory(prefix="edgefl-plot-") as tmp:
            png = Path(tmp) / f"{metric}.png"
            figure.savefig(png, dpi=120)
            sink.figure(figure, png, self.last_step)
        import matplotlib.pyplot as plt
        plt.close(figure)
