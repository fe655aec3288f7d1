"""The sign-vote stage (broker_coordinator/aggregation/votes.py): a coordinate that too few of the
round's updates agree on stays where it is. Units: no broker needed."""

import numpy as np
import pytest

from broker_coordinator.aggregation.robust import RobustRound
from broker_coordinator.aggregation.trust import NormBound
from broker_coordinator.aggregation.votes import SignVotes
from edgefl_protocol import codec
from edgefl_protocol.sparse_delta import sparse_only

SPECS = {"w": (8, 50), "b": (8,)}


def _honest(rng, n: int) -> list[dict[str, np.ndarray]]:
    """Updates that agree on a shared direction, except in the last 10 weights, which they never move."""
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in SPECS.items()}
    out = []
    for _ in range(n):
        d = {k: (base[k] + 0.3 * rng.standard_normal(s)).astype(np.float32) * 1e-2 for k, s in SPECS.items()}
        d["w"][-1, -10:] = 0.0
        out.append(d)
    return out


def test_a_coordinate_only_a_minority_moves_does_not_move():
    rng = np.random.default_rng(0)
    updates = _honest(rng, 9)
    backdoor = {k: v.copy() for k, v in updates[0].items()}
    backdoor["w"][-1, -10:] = 0.5  # what only the attacker trains
    fold = RobustRound(SPECS, NormBound(multiplier=0), "mean", sign_quorum=0.3)
    plain = RobustRound(SPECS, NormBound(multiplier=0), "mean")
    for i, d in enumerate([*updates, backdoor]):
        fold.add(f"d{i}", d, 1.0)
        plain.add(f"d{i}", d, 1.0)
    voted, mean = fold.result(), plain.result()
    assert np.all(mean["w"][-1, -10:] > 0.04)  # the plain mean carries a tenth of the trigger's weights
    assert np.all(voted["w"][-1, -10:] == 0)
    agreed = np.abs(fold.votes.net[:-10]) >= fold.votes.threshold()
    flat_voted = np.concatenate([voted["w"].ravel(), voted["b"]])
    flat_mean = np.concatenate([mean["w"].ravel(), mean["b"]])
    assert np.array_equal(flat_voted[:390][agreed[:390]], flat_mean[:390][agreed[:390]])
    assert 0 < fold.unvoted < 0.5


def test_the_threshold_is_a_share_of_the_round_so_a_round_of_4_is_held_as_a_round_of_10():
    votes4, votes10 = SignVotes(SPECS, 0.3), SignVotes(SPECS, 0.3)
    for _ in range(4):
        votes4.add({k: np.ones(s, np.float32) for k, s in SPECS.items()})
    for _ in range(10):
        votes10.add({k: np.ones(s, np.float32) for k, s in SPECS.items()})
    assert votes4.threshold() == 2 and votes10.threshold() == 3  # at least 2: one device never moves a coordinate


def test_sparse_and_dense_updates_cast_the_same_votes():
    rng = np.random.default_rng(1)
    dense, sparse = SignVotes(SPECS, 0.3), SignVotes(SPECS, 0.3)
    for d in _honest(rng, 5):
        encoded = codec.encode(d, "topk0.1+q4c64+zlib")
        decoded = codec.decode(encoded.codec, encoded.specs, encoded.body, None, 10**7)
        dense.add({k: np.asarray(decoded[k]) for k in SPECS})
        sparse.add(sparse_only(decoded, SPECS))
    assert np.array_equal(dense.net, sparse.net) and np.abs(dense.net).max() > 1


def test_a_site_s_votes_merge_into_the_centre_s():
    rng = np.random.default_rng(2)
    updates = _honest(rng, 8)
    flat, site_a, site_b = SignVotes(SPECS, 0.3), SignVotes(SPECS, 0.3), SignVotes(SPECS, 0.3)
    for i, d in enumerate(updates):
        flat.add(d)
        (site_a if i % 2 else site_b).add(d)
    centre = SignVotes(SPECS, 0.3)
    centre.merge(site_a.net, site_a.count)
    centre.merge(site_b.net, site_b.count)
    assert np.array_equal(centre.net, flat.net) and centre.count == flat.count


def test_the_setting_is_checked():
    from broker_coordinator.settings.round_settings import RoundSettings
    with pytest.raises(ValueError, match="sign_quorum"):
        RoundSettings(sign_quorum=1.0).validate()


def _partial(site: str, updates: list[dict], quorum: float, forged_net: np.ndarray | None = None):
    from edgefl_protocol.site_partials import decode_partial, encode_partial, make_partial
    from broker_coordinator.aggregation.votes import vote_fields
    fold = RobustRound(SPECS, NormBound(multiplier=0), "mean", sign_quorum=quorum)
    for i, d in enumerate(updates):
        fold.add(f"{site}-{i}", d, 1.0)
    stream = fold.streamed()
    fields = vote_fields(fold.votes)
    if forged_net is not None:
        from edgefl_protocol.site_partials import encode_net
        fields = {"votes": encode_net(forged_net), "voters": len(updates)}
    key = b"k" * 32
    data = encode_partial(make_partial("f", site, 0, 1, 1, 0, stream, None, **fields), key)
    return decode_partial(data, key, site, SPECS, {}, 1 << 24)


def test_a_forged_partial_casts_at_most_one_vote_per_device_it_may_count():
    from broker_coordinator.aggregation.tree_sum import TreeSum
    rng = np.random.default_rng(3)
    honest = _honest(rng, 9)
    trigger = np.zeros(sum(int(np.prod(s)) for s in SPECS.values()), dtype=np.int32)
    trigger[390:400] = 1000  # the weights only the attacker moves (w[-1, -10:])
    backdoor = {k: v.copy() for k, v in honest[0].items()}
    backdoor["w"][-1, -10:] = 0.5
    tree = TreeSum(SPECS, False, round_no=1, allowed={"a": 4, "b": 4, "evil": 2}, sign_quorum=0.3)
    for site, updates, forged in (("a", honest[:4], None), ("b", honest[4:8], None),
                                  ("evil", [backdoor, honest[8]], trigger)):
        tree.add(*_partial(site, updates, 0.3, forged))
    assert np.all(np.abs(tree.votes.net[390:400]) <= 2)  # the evil site's 2 devices, not its 1000 claimed
    assert np.all(tree.result()["w"][-1, -10:] == 0)  # 2 votes of 10 deltas: below the quorum of 3
    assert tree.unvoted > 0


def test_a_partial_whose_votes_are_not_one_count_per_parameter_is_rejected():
    from edgefl_protocol.errors import Rejected
    with pytest.raises(Rejected, match="int32 counts"):
        _partial("a", _honest(np.random.default_rng(4), 2), 0.3, forged_net=np.zeros(5, dtype=np.int32))
