"""bench/fedsim.py: a run's `accuracy` is the last global model's whatever the coordinator serves, so
the benchmarks' "last global model" columns mean the same for runs before and after serve_average
became the default; what the coordinator served is beside it. Units: no broker needed."""

import numpy as np

from bench.fedsim import Federation, run
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_models import datasets
from edgefl_models.architectures import build_model, set_weights
from edgefl_models.objectives import Objective


def _federation() -> Federation:
    data = datasets.load("digits")
    shards = [data.train.subset(np.arange(i * 150, (i + 1) * 150)) for i in range(4)]
    return Federation("digits4", "digits_mlp", shards, data.test, rounds=2, clients_per_round=4)


def test_accuracy_is_the_last_model_and_the_served_average_is_beside_it(monkeypatch):
    fed = _federation()
    last_weights = {}
    import bench.fedsim as fedsim
    real = fedsim.InMemoryFederation

    class Spy(real):  # keep the coordinator, to score its last weights after the run
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            last_weights["coordinator"] = self.coordinator

    monkeypatch.setattr(fedsim, "InMemoryFederation", Spy)
    settings = RoundSettings(algorithm="fedavg", codec="float32", local_epochs=1, serve_average=0.75)
    result = run(fed, settings, seed=1)
    model = build_model("digits_mlp")
    set_weights(model, last_weights["coordinator"].weights)
    assert result.accuracy[-1] == Objective().evaluate(model, fed.test).score
    # the served average still holds three quarters of the random start after round 1
    assert result.served_accuracy[0] < result.accuracy[0]
    assert result.served_accuracy == result.ema_accuracy["0.75"]


def test_without_a_served_average_both_are_the_last_model():
    settings = RoundSettings(algorithm="fedavg", codec="float32", local_epochs=1, serve_average=0.0)
    result = run(_federation(), settings, seed=1)
    assert result.accuracy == result.served_accuracy
