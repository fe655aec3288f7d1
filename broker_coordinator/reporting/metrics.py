"""Prometheus metrics for one coordinator (its own registry, so several can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
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
        self.tracking_failures = Counter("edgefl_tracking_failures", "Writes to a run tracker (TensorBoard, "
                                         "MLflow) that failed; the rounds go on", ["sink"], registry=r)

    def serve(self, port: int, bind: str = "127.0.0.1") -> None:
        start_http_server(port, addr=bind, registry=self.registry)
