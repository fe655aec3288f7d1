import numpy as np
import pytest
import torch

from edgefl_models import datasets
from edgefl_models.architectures import ARCHITECTURES, build_model, count_parameters, get_weights


def test_synthetic_matches_the_fedprox_recipe():
    users = datasets.generate_synthetic(1.0, 1.0, num_users=30, seed=0)
    assert len(users) == 30
    for user in users:
        assert user.x.shape[1] == 60 and user.x.dtype == np.float32
        assert len(user) >= 50  # lognormal + 50
        assert set(np.unique(user.y)) <= set(range(10))
    again = datasets.generate_synthetic(1.0, 1.0, num_users=30, seed=0)
    assert all(np.array_equal(a.x, b.x) for a, b in zip(users, again))


def test_synthetic_federated_split_keeps_users_apart():
    data = datasets.load("synthetic:0.5,0.5", num_users=5, seed=1)
    assert len(data.natural_shards) == 5
    assert sum(len(s) for s in data.natural_shards) == len(data.train)
    assert data.model == "logreg60"


def test_mnist5k_split_is_the_benchmark_split():
    data = datasets.load("mnist5k")
    assert data.train.x.shape == (4000, 1, 28, 28) and data.test.x.shape == (1000, 1, 28, 28)
    assert np.bincount(np.concatenate([data.train.y, data.test.y])).tolist() == [500] * 10
    assert abs(float(data.train.x.mean())) < 0.1  # standardized


def test_digits_loads():
    data = datasets.load("digits")
    assert data.train.x.shape[1] == 64 and len(data.train) + len(data.test) == 1797


def test_digits_read_without_sklearn_are_sklearns_digits(monkeypatch):
    """load_digits reads sklearn's file with numpy; sklearn's own loader (the fallback when the file is
    elsewhere) gives exactly the same data set."""
    pytest.importorskip("sklearn")
    assert datasets.digits_table() is not None
    direct = datasets.load("digits")
    monkeypatch.setattr(datasets, "digits_table", lambda: None)
    through_sklearn = datasets.load("digits")
    for a, b in ((direct.train, through_sklearn.train), (direct.test, through_sklearn.test)):
        assert a.x.dtype == b.x.dtype == np.float32 and a.y.dtype == b.y.dtype == np.int64
        assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)


def test_unknown_dataset_says_what_exists():
    with pytest.raises(datasets.DatasetError, match="choose mnist5k, digits or synthetic"):
        datasets.load("cifar10")


def test_npz_round_trip_and_errors(tmp_path):
    data = datasets.Dataset(np.ones((5, 64), np.float32), np.arange(5))
    datasets.save_npz(tmp_path / "d.npz", data)
    assert np.array_equal(datasets.load_npz(tmp_path / "d.npz").y, data.y)
    with pytest.raises(datasets.DatasetError, match="does not exist"):
        datasets.load_npz(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(datasets.DatasetError, match="cannot read"):
        datasets.load_npz(tmp_path / "junk.npz")
    np.savez(tmp_path / "bad.npz", x=np.ones((5, 64)), y=np.ones(4, dtype=np.int64))
    with pytest.raises(datasets.DatasetError, match="x must be"):
        datasets.load_npz(tmp_path / "bad.npz")


@pytest.mark.parametrize("name,params", [("mnist_cnn", 80202), ("digits_mlp", 4810), ("logreg60", 610)])
def test_models_shapes_counts_and_seeded_init(name, params):
    arch = ARCHITECTURES[name]
    model = build_model(name, seed=1)
    assert count_parameters(model) == params
    assert f"{params:,}" in type(model).__doc__  # the docstring states the count
    out = model(torch.zeros((3, *arch.input_shape)))
    assert out.shape == (3, arch.num_classes)
    same, other = get_weights(build_model(name, seed=1)), get_weights(build_model(name, seed=2))
    weights = get_weights(model)
    assert all(np.array_equal(weights[k], same[k]) for k in weights)
    assert not all(np.array_equal(weights[k], other[k]) for k in weights)
