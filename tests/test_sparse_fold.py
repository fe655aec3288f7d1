"""The fold's fast paths on a decoded top-k update's nonzeros (edgefl_protocol/sparse_delta.py) give
what the dense path gives: the same sums exactly, norms and sketches to float rounding, the same
verdicts. Units: no broker needed."""

import copy

import numpy as np
import pytest

from broker_coordinator.aggregation.consensus import Sketcher
from broker_coordinator.aggregation.robust import RobustRound, l2_norm
from broker_coordinator.aggregation.streaming import StreamingMean
from broker_coordinator.aggregation.trust import NormBound
from edgefl_protocol import codec
from edgefl_protocol.sparse_delta import SparseDelta, sparse_only

SPECS = {"conv.weight": (16, 1, 5, 5), "conv.bias": (16,), "fc.weight": (10, 400), "fc.bias": (10,)}
CODEC = "topk0.1+q4c64+zlib"


def _decoded(rng, scale: float = 1e-3, extra: bool = False):
    tensors = {n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in SPECS.items()}
    if extra:  # an algorithm's extra tensor, sent exactly beside the model's
        tensors["extra.h.fc.bias"] = rng.standard_normal(10).astype(np.float32)
    encoded = codec.encode(tensors, CODEC)
    return codec.decode(encoded.codec, encoded.specs, encoded.body, None, 10**7)


def test_a_decoded_top_k_update_carries_its_nonzeros():
    delta = _decoded(np.random.default_rng(0))
    sparse = sparse_only(delta, SPECS)
    assert isinstance(sparse, SparseDelta) and sparse.names == tuple(SPECS)
    assert np.all(np.diff(sparse.positions) > 0)  # distinct and increasing
    for name in SPECS:
        assert np.array_equal(sparse[name], delta[name]) and sparse[name].shape == SPECS[name]
    dense = np.concatenate([np.ravel(delta[n]) for n in SPECS])
    assert np.array_equal(dense[sparse.positions], sparse.values)
    assert np.count_nonzero(dense) == np.count_nonzero(sparse.values)  # nothing outside the positions
    assert sparse.norm() == pytest.approx(l2_norm({n: delta[n] for n in SPECS}), rel=1e-6)
    scaled = sparse.scaled(0.37)
    for name in SPECS:
        assert np.array_equal(scaled[name], delta[name] * 0.37)


def test_a_delta_whose_tensors_differ_from_the_fold_s_stays_a_plain_mapping():
    delta = _decoded(np.random.default_rng(1), extra=True)
    model = sparse_only(delta, SPECS)  # the model's tensors come first, the algorithm's extra after
    assert isinstance(model, SparseDelta) and model.names == tuple(SPECS)
    assert model.positions.max() < model.size
    for name in SPECS:
        assert np.array_equal(model[name], delta[name])
    reordered = dict(reversed(list(SPECS.items())))
    assert type(sparse_only(delta, reordered)) is dict
    assert type(sparse_only({n: delta[n] for n in SPECS}, SPECS)) is dict


def test_streaming_sums_of_nonzeros_equal_the_dense_sums_exactly():
    rng = np.random.default_rng(2)
    dense, sparse = StreamingMean(SPECS, normalize_steps=True), StreamingMean(SPECS, normalize_steps=True)
    for k in range(7):
        delta = _decoded(rng)
        dense.add({n: delta[n] for n in SPECS}, weight=1.0 + k, steps=k + 1)
        sparse.add(sparse_only(delta, SPECS), weight=1.0 + k, steps=k + 1)
    for name, value in dense.mean().items():
        assert np.array_equal(value, sparse.mean()[name])


def test_the_sketch_of_the_nonzeros_is_the_dense_sketch():
    sketcher = Sketcher(SPECS, dim=256)
    delta = _decoded(np.random.default_rng(3))
    dense = sketcher({n: delta[n] for n in SPECS})
    np.testing.assert_allclose(sketcher(sparse_only(delta, SPECS)), dense, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("aggregator", ["centered_clip", "mean"])
def test_the_robust_fold_of_nonzeros_is_the_dense_fold(aggregator):
    """A warm round with a centre, honest deltas, one inflated (norm bound) and one reversed (radius):
    the same verdicts and the same aggregate either way."""
    rng = np.random.default_rng(4)
    bound, radius = NormBound(1.5), NormBound(1.5)
    for i in range(30):
        bound.observe(0.02, f"past-{i}", None)
        radius.observe(0.02, f"past-{i}", None)
    center = {n: (rng.standard_normal(s) * 2e-4).astype(np.float32) for n, s in SPECS.items()}
    updates = [_decoded(rng) for _ in range(8)] + [_decoded(rng, scale=5e-3), _decoded(rng, scale=-3e-3)]
    rounds = []
    for fast in (False, True):
        fold = RobustRound(SPECS, copy.deepcopy(bound), aggregator=aggregator,
                           center=center if aggregator == "centered_clip" else None, radius=copy.deepcopy(radius))
        for i, delta in enumerate(updates):
            fold.add(f"dev-{i}", sparse_only(delta, SPECS) if fast else {n: delta[n] for n in SPECS}, 1.0 + i)
        rounds.append(fold)
    dense, sparse = rounds
    assert dense.clipped.keys() == sparse.clipped.keys() and dense.clipped  # the inflated one
    assert dense.centered.keys() == sparse.centered.keys()
    if aggregator == "centered_clip":
        assert dense.centered  # the radius clipped someone
        for device, sketch in dense.sketches.items():
            np.testing.assert_allclose(sparse.sketches[device], sketch, rtol=1e-4, atol=1e-9)
    for name, value in dense.result().items():
        np.testing.assert_allclose(sparse.result()[name], value, rtol=1e-5, atol=1e-10)
