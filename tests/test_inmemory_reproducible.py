"""bench/inmemory.py: two runs of the same federation give the same model (the codec's rounding
is seeded per device, round and run), so benchmark reruns reproduce and rows compare on the same
device work. Units: no broker needed."""

import numpy as np

from bench.inmemory import InMemoryFederation
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_models import datasets


def _weights_after_two_rounds(seed: int) -> list[np.ndarray]:
    data = datasets.load("digits")
    shards = [data.train.subset(np.arange(i * 150, (i + 1) * 150)) for i in range(4)]
    settings = RoundSettings(algorithm="fedavg", codec="q4c64+zlib", local_epochs=1, batch_size=32)
    fed = InMemoryFederation("digits_mlp", shards, data.test, settings, seed=seed, clients_per_round=4)
    for round_no in (1, 2):
        fed.round(round_no)
    return [np.array(w) for w in fed.coordinator.weights.values()]


def test_a_rerun_of_a_quantized_federation_gives_the_same_model_and_another_seed_does_not():
    first, again, other = _weights_after_two_rounds(1), _weights_after_two_rounds(1), _weights_after_two_rounds(2)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
