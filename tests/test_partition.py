import numpy as np
import pytest

from edgefl_models import partition


def labels(n_per_class: int = 100, classes: int = 10) -> np.ndarray:
    return np.repeat(np.arange(classes), n_per_class)


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.1", "dirichlet:1", "shards:2"])
def test_every_sample_assigned_exactly_once(spec):
    y = labels()
    parts = partition.split(spec, y, 10, seed=3)
    assert len(parts) == 10
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(len(y)))


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.3", "shards:2"])
def test_deterministic_by_seed(spec):
    y = labels()
    a = partition.split(spec, y, 8, seed=7)
    b = partition.split(spec, y, 8, seed=7)
    c = partition.split(spec, y, 8, seed=8)
    assert all(np.array_equal(x, z) for x, z in zip(a, b))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))


def label_entropy(y: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean per-client label entropy in bits (log2(10) = 3.32 for a uniform mix)."""
    values = []
    for part in parts:
        p = np.bincount(y[part], minlength=10) / len(part)
        p = p[p > 0]
        values.append(float(-(p * np.log2(p)).sum()))
    return float(np.mean(values))


def test_dirichlet_skews_labels_and_more_so_for_small_alpha():
    y = labels(200)
    iid = label_entropy(y, partition.split("iid", y, 10, seed=0))
    mild = label_entropy(y, partition.split("dirichlet:1", y, 10, seed=0))
    strong = label_entropy(y, partition.split("dirichlet:0.1", y, 10, seed=0))
    assert iid > 3.2
    assert strong < mild < iid
    assert strong < 2.0


def test_dirichlet_respects_minimum_size():
    parts = partition.split("dirichlet:0.1", labels(), 20, seed=0)
    assert min(len(p) for p in parts) >= partition.MIN_CLIENT_SAMPLES


def test_shards_give_k_classes_per_client():
    y = labels(100)
    parts = partition.split("shards:2", y, 10, seed=0)
    assert all(len(np.unique(y[p])) <= 2 for p in parts)


@pytest.mark.parametrize("spec", ["dirichlet", "dirichlet:0", "dirichlet:-1", "shards:0", "shards:1.5", "zipf:2", "iid:3"])
def test_bad_specs_are_refused_with_the_valid_forms(spec):
    with pytest.raises(ValueError, match="use iid, dirichlet:A"):
        partition.parse(spec)


def test_natural_needs_matching_users():
    y = labels()
    with pytest.raises(ValueError, match="natural"):
        partition.split("natural", y, 3, seed=0)
    shards = [np.arange(0, 500), np.arange(500, 1000)]
    with pytest.raises(ValueError, match="2 natural users but 3"):
        partition.split("natural", y, 3, seed=0, natural=shards)
