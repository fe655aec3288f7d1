"""Sign votes per coordinate: a round moves a coordinate only where enough of its updates agree.

A backdoor's trigger sits in inputs that honest data holds constant: with the MNIST MLP of
bench/attacks.py, the corner pixels its trigger lights up are background in every digit (-0.42
after the loader's standardization, not 0, so honest devices do move the weights from them, as
they move a bias). There the attackers pull one way where the honest updates do not agree, and a
length bound or a centre cannot tell a few such coordinates from honest noise. The robust
learning rate of Ozdayi, Kantarcioglu and Gel (AAAI 2021) counts, per coordinate, the signs of
the round's updates; where the net count is below a threshold the server does not step (their
soft variant: it zeroes the coordinate instead of reversing it). The count is one vector the
size of the model, summed as updates arrive, and counts add across sites: the stage streams.

The threshold is a fraction of the round's folded updates (at least 2), so that a round of 4 is
held to the same share as a round of 10.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from edgefl_protocol.site_partials import encode_net
from edgefl_protocol.sparse_delta import SparseDelta


class SignVotes:
    def __init__(self, specs: Mapping[str, tuple[int, ...]], quorum: float) -> None:
        self.names = tuple(specs)
        self.shapes = dict(specs)
        self.quorum = quorum
        self.net = np.zeros(sum(int(np.prod(s)) for s in specs.values()), dtype=np.int32)
        self.count = 0

    def add(self, delta: Mapping[str, np.ndarray]) -> None:
        if isinstance(delta, SparseDelta) and delta.names == self.names:
            self.net[delta.positions] += np.sign(delta.values).astype(np.int32)
        else:
            self.net += np.concatenate([np.sign(np.ravel(delta[n])) for n in self.names]).astype(np.int32)
        self.count += 1

    def merge(self, net: np.ndarray, count: int) -> None:
        self.net += np.asarray(net, dtype=np.int32)
        self.count += count

    def threshold(self) -> int:
        return max(2, math.ceil(self.quorum * self.count))

    def mask(self, aggregate: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        """The aggregate with the coordinates below quorum zeroed, and the fraction zeroed."""
        keep = np.abs(self.net) >= self.threshold()
        out, start = {}, 0
        for n in self.names:
            size = int(np.prod(self.shapes[n]))
            out[n] = np.where(keep[start:start + size].reshape(self.shapes[n]), aggregate[n], 0).astype(np.float32)
            start += size
        return out, 1.0 - float(keep.mean())


def vote_fields(votes: SignVotes | None) -> dict[str, object]:
    """What a site's partial carries of its fold's votes: {} when the stage is off."""
    if votes is None:
        return {}
    return {"votes": encode_net(votes.net), "voters": votes.count}
