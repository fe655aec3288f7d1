"""Prometheus metrics for one coordinator (its own registry, so several can live in one process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Counter("edgefl_rounds", "Rounds finished, by outcome", ["outcome"], registry=r)
        self.accepted = Counter("edgefl_updates_accepted", "Updates folded into the aggregate", registry=r)
        self.rejected = Counter("edgefl_updates_rejected", "Updates rejected, by reason", ["reason"], registry=r)
        self.bounded = Counter("edgefl_updates_bounded", "Accepted updates the server bounded: weight clipped, "
                               "norm clipped, clipped towards the centre, left out for their direction, or "
                               "disagreeing with their round or departing from it like another device (kin; the device weighs "
                               "less from then on), or held back with a flagged update's partial sum (held_back)",
                               ["how"], registry=r)
        self.bytes_up = Counter("edgefl_update_bytes", "Bytes of accepted updates received", registry=r)
        self.round_seconds = Histogram("edgefl_round_duration_seconds", "Wall time per round", registry=r,
                                       buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.accuracy = Gauge("edgefl_test_accuracy", "Global model accuracy on the held-out set "
                              "(classification tasks)", registry=r)
        self.score = Gauge("edgefl_model_score", "The task's metric for the global model (accuracy, mse or mae), "
                           "on the coordinator's test set (central) or the devices' held-out slices (devices)",
                           ["metric", "where"], registry=r)
        self.loss = Gauge("edgefl_test_loss", "Global model loss on the held-out set", registry=r)
        self.round = Gauge("edgefl_round", "Last finished round", registry=r)
        self.left_out = Gauge("edgefl_round_left_out_fraction", "Fraction of the last round's accepted updates "
                              "that the fold left out (direction gate, or the attempt was abandoned)", registry=r)
        self.unvoted = Gauge("edgefl_round_unvoted_fraction", "Fraction of the model's parameters the last round's "
                             "sign votes held still ([rounds] sign_quorum > 0)", registry=r)
        self.privacy_epsilon = Gauge("edgefl_privacy_epsilon", "Epsilon spent so far at the configured delta "
                                     "([privacy] mode = central; user-level, over the applied versions)", registry=r)
        self.online = Gauge("edgefl_devices_online", "Devices whose status is online", registry=r)
        self.agents = Gauge("edgefl_agents", "Online devices by the EdgeFL release their agent runs ('unknown': "
                            "an agent of 0.1.0, which does not say)", ["version"], registry=r)
        # per device (bounded by the enrolled fleet: only devices with a key or a status get a series)
        self.device_online = Gauge("edgefl_device_online", "1 while the device's status is online", ["device"],
                                   registry=r)
        self.device_eligible = Gauge("edgefl_device_eligible", "1 while an online device may be selected (its "
                                     "owner's conditions, its agent's protocol)", ["device"], registry=r)
        self.device_updates = Counter("edgefl_device_updates", "A device's answers by what became of them: folded, "
                                      "clipped, left_out (the fold's verdict) or rejected", ["device", "outcome"],
                                      registry=r)
        # what the alert rules read (deploy/prometheus/edgefl-rules.yml)
        self.started = Gauge("edgefl_coordinator_start_timestamp_seconds", "When this coordinator process started "
                             "(unix seconds)", registry=r)
        self.started.set_to_current_time()
        self.last_round_time = Gauge("edgefl_last_round_timestamp_seconds", "When the last round closed (unix "
                                     "seconds)", registry=r)
        self.pacing_interval = Gauge("edgefl_pacing_interval_seconds", "[pacing] interval: the least time between "
                                     "rounds", registry=r)
        self.resting = Gauge("edgefl_resting", "1 while the federation rests ([pacing] patience): no round is due",
                             registry=r)
        self.privacy_target = Gauge("edgefl_privacy_epsilon_target", "[privacy] target_epsilon: the budget "
                                    "(0: none)", registry=r)
        self.tracking_failures = Counter("edgefl_tracking_failures", "Writes to a run tracker (TensorBoard, "
                                         "MLflow) that failed; the rounds go on", ["sink"], registry=r)

    def serve(self, port: int, bind: str = "127.0.0.1",
              snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        """/metrics on `port`; with `snapshot`, the dashboard too (/ and /fleet.json: reporting/dashboard.py)."""
        from .dashboard import MetricsServer
        self.server = MetricsServer(self.registry, port, bind, snapshot)
