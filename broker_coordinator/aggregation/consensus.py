"""A device's standing from how its updates agree with the rest of their rounds.

centered_clip judges an update by its length from a centre. Under non-IID data
an attacker's update can be as long as an honest one and still point the other
way: a sign-flipped or label-flipped update was clipped by neither bound in
bench/attacks.py. What gives it away is its direction against the round: the
median cosine of an honest update with the other updates of its round is
positive (its data and theirs share a task), a flipped one's is negative. From
cached runs of bench/attacks.py (seed 2, 20% attackers): every honest update of
10 rounds had a median pairwise cosine of at least -0.01 (typically 0.03-0.4),
while sign- and label-flipped updates sat at -0.03 to -0.5 until the model
converged.

The fold streams, so it cannot hold the round to compare: each update leaves a
sketch of `SKETCH_DIM` numbers (a count sketch: every coordinate with a fixed
random sign, summed into SKETCH_DIM buckets, which keeps cosines within about
1/sqrt(SKETCH_DIM) for dense and for the top-k codec's sparse deltas alike),
memory O(model + cohort x SKETCH_DIM). When the round
closes, an update whose median cosine with the others is below
min(-agreement_floor, median - MAD_MULTIPLIER x MAD) of the round's is flagged
(`agreement_floor`, 0 by default: a margin for the sketch's error, since near
convergence honest non-IID updates are nearly orthogonal and their median
cosines scatter just below 0; docs/RESEARCH.md). Only a round with a majority
is judged: the median of its updates' median cosines must be above `noise`,
the cosine two unrelated updates show (1/sqrt of the model's parameters, at
most SKETCH_DIM). On FedProx's Synthetic(1,1) (610 parameters, noise 0.04) the
rounds' medians sat within +-0.04 of 0 and judging them flagged 9-12% of honest
updates, and attackers' updates were indistinguishable from honest ones by
their cosines; on MNIST the rounds' medians were 0.03-0.33 and the rule kept
the attackers' flags (bench/attacks.py, docs/RESEARCH.md). A device's
standing is 1 - FLAG_COST x (its flags among its last `WINDOW` judged updates)
/ WINDOW, at least `MIN_STANDING`, and scales its weight from its next update
on (the round it was flagged in is already folded). A rate over a window, not a
factor per round: an attacker is flagged in most of its rounds but not all
(the signal weakens as the model converges), and one unflagged round must not
give it its weight back. So a persistent attacker keeps about MIN_STANDING
after three flags, while an honest device flagged once (about 2 in 100 honest
updates in those runs) keeps 0.6 of its weight for its next WINDOW updates.

Where each device holds a few classes, honest updates point away from their
rounds too, now and then, and the flags add up: in the clean runs of `make
field-settings` a first flag's cost down-weighted 16% of honest updates on
MNIST-5k Dirichlet(0.1) and a third on digits' label shards. `agreement_flags`
(default 1) is the number of flags in the window before the weight falls; at 2
one odd round costs nothing, and attackers lose their weight a judged update
later (docs/RESEARCH.md has both sides). A flagged update that is a copy of
another of its round (sketch cosine above COPY_COSINE) counts as COPY_FLAGS
flags: honest devices' data differ, so their updates never are copies, while
Sybils sending one crafted update are (FoolsGold's premise, below).

Kinship (`kinship` > 0) flags what the round's median cannot see: attackers
that share one goal without pointing away from the round. A backdoored or
label-flipped update agrees with its round about as well as an honest one;
what gives it away is that it departs from the round the same way every round,
and the same way as its accomplices' (FoolsGold, Fung et al., RAID 2020). Each
judged update adds its departure (its unit sketch less the round's mean unit
sketch, folded to KIN_DIM buckets) to its device's path; a device whose path,
after KIN_MIN_ROUNDS judged updates, has a cosine above `kinship` with another
device's path is flagged like a disagreeing one. Honest devices' departures are
their own data's and do not add up alike. From sketches captured in
bench/attacks.py runs (10 rounds, MLP): honest paths' largest cosine with any
other path was at most 0.33 (clean, label flip, backdoor at 10%), backdoor
attackers' 0.40-0.49 at 10%, label flippers' 0.39-0.65 at 20% from their third
round on. Off by default: in bench/attacks.py itself (row
centered_clip+kinship0.4) the backdoor, learned by round 3, still succeeded on
92-100% of stamped images, 20% flips cost more, and honest Synthetic(1,1)
devices were flagged (docs/RESEARCH.md). A site judges its own devices only:
accomplices split over sites are each judged among strangers. Memory: KIN_DIM float32 per device (at most
MAX_PATHS devices, the least recently judged forgotten first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from broker_coordinator.aggregation.trust import MIN_STANDING
from broker_coordinator.settings.choices import (
    AGREEMENT_WINDOW,
    DEFAULT_AGREEMENT_FLAGS,
    DEFAULT_AGREEMENT_FLOOR,
    DEFAULT_KINSHIP,
)
from edgefl_protocol.sparse_delta import SparseDelta

SKETCH_DIM = 2048  # cosines of sketches within about 0.02 of the true ones (tests/test_consensus.py)
MIN_JUDGED = 4  # fewer updates in a round: no majority to speak of, nothing is flagged
MAD_MULTIPLIER = 2.0
WINDOW = AGREEMENT_WINDOW  # judged updates per device remembered
FLAG_COST = 2.0  # each flag in the window costs 2 / WINDOW of the weight
COPY_COSINE = 0.95  # a flagged update this close to another of its round is a copy: it counts COPY_FLAGS
COPY_FLAGS = 2
SEED = 20211  # fixed: a site and the centre sketch the same way
KIN_DIM = 512  # a path's buckets (the sketch folded: SKETCH_DIM is a multiple)
KIN_MIN_ROUNDS = 3  # judged updates before a device's path is compared: one or two departures are noise
MAX_PATHS = 10_000  # devices whose paths are kept (KIN_DIM x 4 bytes each)


class Sketcher:
    """A delta's count sketch: its coordinates, each with a fixed random sign, summed into `dim`
    buckets (coordinate j into bucket j mod dim). The signs make every cross term zero in expectation,
    so the inner product of two sketches estimates theirs with a spread of about |x||y|/sqrt(dim),
    whether the deltas are dense or sparse. Contiguous buckets keep it to one multiply and one
    strided sum: about 0.08 ms for the 80k CNN, where the subsampled Hadamard transform this
    replaced took 0.43 ms, a sixth of the coordinator's CPU per update, for the same accuracy
    (rms cosine error 0.015-0.021 against 0.016-0.018 on top-k sparse deltas of the CNN's shape)."""

    def __init__(self, specs: Mapping[str, tuple[int, ...]], dim: int = SKETCH_DIM, seed: int = SEED) -> None:
        self.names = list(specs)
        self.size = sum(int(np.prod(shape)) for shape in specs.values())
        self.dim = dim
        self.rows = max(1, -(-self.size // dim))
        rng = np.random.default_rng(seed)
        self.coordinate_signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), self.size)

    def __call__(self, delta: Mapping[str, np.ndarray]) -> np.ndarray:
        if isinstance(delta, SparseDelta) and delta.names == tuple(self.names):  # the nonzeros alone
            signed = delta.values * self.coordinate_signs[delta.positions]
            buckets = delta.positions & (self.dim - 1) if self.dim & (self.dim - 1) == 0 else delta.positions % self.dim
            return np.bincount(buckets, weights=signed, minlength=self.dim).astype(np.float32)
        folded = np.zeros(self.rows * self.dim, dtype=np.float32)
        start = 0
        for n in self.names:
            values = np.ravel(np.asarray(delta[n], dtype=np.float32))
            np.multiply(values, self.coordinate_signs[start:start + len(values)], out=folded[start:start + len(values)])
            start += len(values)
        return folded.reshape(self.rows, self.dim).sum(axis=0)


CHUNK = 128  # rows of the cosine matrix at a time: the round's close stays O(cohort x SKETCH_DIM)


def median_cosines(sketches: np.ndarray) -> np.ndarray:
    """Each row's median cosine with the other rows, in float32 (the sketch is good to about 0.02)
    and CHUNK rows at a time: the whole matrix in float64 cost 40 MB of peak memory at 1,000
    updates a round (bench/runtime.py)."""
    unit = _unit_rows(np.array(sketches, dtype=np.float32))
    out = np.empty(len(unit))
    for start in range(0, len(unit), CHUNK):
        block = unit[start:start + CHUNK] @ unit.T
        rows = np.arange(len(block))
        block[rows, start + rows] = np.nan
        out[start:start + len(block)] = np.nanmedian(block, axis=1)
    return out


def noise(dimension: int) -> float:
    """The spread of the cosine of two unrelated updates of `dimension` coordinates as the sketch sees
    them (at most SKETCH_DIM buckets): 1/sqrt(dimension)."""
    return 1.0 / float(np.sqrt(max(1, min(dimension, SKETCH_DIM))))


def disagreeing(sketches: Mapping[str, np.ndarray], floor: float = DEFAULT_AGREEMENT_FLOOR,
                dimension: int = SKETCH_DIM) -> dict[str, float]:
    """device -> its median cosine, for the updates of a round that point away from its majority: below
    -floor and below the round's median less MAD_MULTIPLIER x its MAD; only in a round that has a
    majority (its median cosine above `noise`: the module's docstring says why)."""
    return _judged(sketches, floor, dimension) or {}


def _judged(sketches: Mapping[str, np.ndarray], floor: float, dimension: int) -> dict[str, float] | None:
    """`disagreeing`, or None when the round cannot be judged (too few updates, or no majority)."""
    if len(sketches) < MIN_JUDGED:
        return None
    devices = list(sketches)
    medians = median_cosines(np.stack([sketches[d] for d in devices]))
    middle = float(np.median(medians))
    if middle <= noise(dimension):
        return None
    spread = float(np.median(np.abs(medians - middle)))
    threshold = min(-floor, middle - MAD_MULTIPLIER * spread)
    return {d: float(m) for d, m in zip(devices, medians) if m < threshold}


def _copies(sketches: Mapping[str, np.ndarray], flagged: Mapping[str, float]) -> set[str]:
    """The flagged devices whose update is a near copy of another update of the round: honest devices'
    data differ, so their updates never are; Sybils sending one crafted update are (FoolsGold's premise)."""
    if not flagged:
        return set()
    devices = list(sketches)
    unit = _unit_rows(np.stack([np.asarray(sketches[d], dtype=np.float32) for d in devices]))
    row_of = {d: i for i, d in enumerate(devices)}
    rows = [row_of[d] for d in flagged]
    cosines = unit[rows] @ unit.T
    cosines[np.arange(len(rows)), rows] = -1.0  # not a copy of itself
    return {devices[r] for r, best in zip(rows, cosines.max(axis=1)) if best > COPY_COSINE}


def _unit_rows(rows: np.ndarray) -> np.ndarray:
    """`rows` scaled in place to unit length (a zero row stays zero), for cosines by dot products."""
    rows /= np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return rows


def _folded(sketch: np.ndarray) -> np.ndarray:
    """A sketch in KIN_DIM buckets (bucket j mod KIN_DIM): itself a count sketch of the delta."""
    flat = np.ravel(np.asarray(sketch, dtype=np.float32))
    padded = np.zeros(-(-len(flat) // KIN_DIM) * KIN_DIM, dtype=np.float32)
    padded[:len(flat)] = flat
    return padded.reshape(-1, KIN_DIM).sum(axis=0)


class Consensus:
    """Devices' standing from the agreement of their updates with their rounds (checkpointed)."""

    def __init__(self, kinship: float = DEFAULT_KINSHIP, floor: float = DEFAULT_AGREEMENT_FLOOR,
                 flags_to_act: int = DEFAULT_AGREEMENT_FLAGS) -> None:
        self.kinship = kinship
        self.floor = floor  # `agreement_floor`: how far below 0 a median cosine must be to flag
        self.flags_to_act = flags_to_act  # `agreement_flags`: flags in the window before the weight falls
        self.flags: dict[str, list[int]] = {}  # device -> its flags (0, 1, COPY_FLAGS) in its last WINDOW judged updates
        self.paths: dict[str, np.ndarray] = {}  # device -> the sum of its judged updates' departures (kinship)
        self.judged: dict[str, int] = {}  # device -> its judged updates (insertion order: least recent first)
        self.kin: dict[str, tuple[str, float]] = {}  # the last judged round's kin: device -> (closest, cosine)
        self._sketcher: tuple[tuple, Sketcher] | None = None  # built once per model shape

    def sketch(self, specs: Mapping[str, tuple[int, ...]], delta: Mapping[str, np.ndarray]) -> np.ndarray:
        key = tuple((n, tuple(shape)) for n, shape in specs.items())
        if self._sketcher is None or self._sketcher[0] != key:
            self._sketcher = (key, Sketcher(specs))
        return self._sketcher[1](delta)

    def of(self, device: str) -> float:
        """The share of its weight the device keeps."""
        flags = sum(self.flags.get(device, ()))
        return max(MIN_STANDING, 1.0 - FLAG_COST * flags / WINDOW) if flags >= self.flags_to_act else 1.0

    def judge(self, sketches: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Flag a closed round's disagreeing updates (returned) and its kin (in `kin`), and remember
        every judged device's verdict."""
        self.kin = {}
        flagged = _judged(sketches, self.floor, self._sketcher[1].size if self._sketcher else SKETCH_DIM)
        if flagged is None:
            return {}  # no majority to speak of: nothing judged, nothing remembered
        if self.kinship > 0:
            self.kin = self._kinship(sketches)
        copies = _copies(sketches, flagged)
        for device in sketches:
            history = self.flags.setdefault(device, [])
            history.append(COPY_FLAGS if device in copies else int(device in flagged or device in self.kin))
            del history[:-WINDOW]
            if not any(history):
                del self.flags[device]  # nothing to remember: the device keeps all of its weight
        return flagged

    def _kinship(self, sketches: Mapping[str, np.ndarray]) -> dict[str, tuple[str, float]]:
        """Add the round's departures to the devices' paths; the round's devices whose path is too
        like another's, with that device and the cosine."""
        devices = list(sketches)
        unit = _unit_rows(np.stack([_folded(sketches[d]) for d in devices]))
        departures = unit - unit.mean(axis=0)
        for device, departure in zip(devices, departures):
            self.paths[device] = self.paths.pop(device, 0) + departure  # re-inserted: most recently judged
            self.judged[device] = self.judged.pop(device, 0) + 1
        while len(self.paths) > MAX_PATHS:
            oldest = next(iter(self.judged))
            del self.judged[oldest], self.paths[oldest]
        known = [d for d, n in self.judged.items() if n >= KIN_MIN_ROUNDS]
        judged = [d for d in devices if self.judged.get(d, 0) >= KIN_MIN_ROUNDS]  # pruned: forgotten
        if len(known) < 2 or not judged:
            return {}
        paths = _unit_rows(np.stack([self.paths[d] for d in known]))
        row = {d: i for i, d in enumerate(known)}
        kin = {}
        for start in range(0, len(judged), CHUNK):
            block = judged[start:start + CHUNK]
            cosines = paths[[row[d] for d in block]] @ paths.T
            cosines[np.arange(len(block)), [row[d] for d in block]] = -np.inf  # not its own kin
            closest = np.argmax(cosines, axis=1)
            for device, j, cosine in zip(block, closest, cosines[np.arange(len(block)), closest]):
                if cosine > self.kinship:
                    kin[device] = (known[j], float(cosine))
        return kin

    def state(self) -> dict[str, Any]:
        # paths in float16: a cosine needs no more, and a checkpoint keeps KIN_DIM x 2 bytes per device
        return {"flags": {d: list(f) for d, f in self.flags.items()},
                "paths": {d: p.astype(np.float16) for d, p in self.paths.items()}, "judged": dict(self.judged)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.flags = {str(d): [min(COPY_FLAGS, max(0, int(x))) for x in f][-WINDOW:]
                      for d, f in (state.get("flags") or {}).items()}
        judged = state.get("judged") or {}
        self.paths = {str(d): np.asarray(p, dtype=np.float32).reshape(KIN_DIM)
                      for d, p in (state.get("paths") or {}).items() if d in judged}
        self.judged = {str(d): int(n) for d, n in judged.items() if str(d) in self.paths}
