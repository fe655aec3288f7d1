"""Split a training set across clients, deterministically by seed.

Specs, as written on the command line:
    iid            uniform random split
    dirichlet:A    per class, proportions ~ Dirichlet(A * ones(clients)); small A = strong label skew
    shards:K       sort by label, cut into clients*K shards, K shards per client (McMahan et al.)
    natural        the dataset's own users (Synthetic only)
"""

from __future__ import annotations

import numpy as np

MIN_CLIENT_SAMPLES = 10


def parse(spec: str) -> tuple[str, float]:
    kind, _, arg = spec.partition(":")
    if kind in ("iid", "natural") and not arg:
        return kind, 0.0
    try:
        value = float(arg)
    except ValueError:
        value = float("nan")
    if kind == "dirichlet" and value > 0:
        return kind, value
    if kind == "shards" and value >= 1 and value == int(value):
        return kind, value
    raise ValueError(f"bad partition {spec!r}: use iid, dirichlet:A (A > 0), shards:K (K >= 1) or natural")


def iid(labels: np.ndarray, clients: int, seed: int) -> list[np.ndarray]:
    perm = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(perm, clients)]


def dirichlet(labels: np.ndarray, clients: int, alpha: float, seed: int,
              min_size: int = MIN_CLIENT_SAMPLES, attempts: int = 1000) -> list[np.ndarray]:
    """Label skew: each class is cut among clients by Dirichlet(alpha) proportions.

    Redraws until every client holds at least `min_size` samples (the common
    recipe, also used for the benchmark partition in bench/data).
    """
    if clients * min_size > len(labels):
        raise ValueError(f"{len(labels)} samples cannot give {clients} clients {min_size} samples each")
    rng = np.random.default_rng(seed)
    for _ in range(attempts):
        parts: list[list[int]] = [[] for _ in range(clients)]
        for c in np.unique(labels):
            index = np.flatnonzero(labels == c)
            rng.shuffle(index)
            cuts = (np.cumsum(rng.dirichlet(alpha * np.ones(clients))) * len(index)).astype(int)[:-1]
            for k, piece in enumerate(np.split(index, cuts)):
                parts[k].extend(piece.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"dirichlet:{alpha} gave some client fewer than {min_size} samples in {attempts} draws; "
                     "use fewer clients or a larger alpha")


def shards(labels: np.ndarray, clients: int, per_client: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, clients * per_client)
    chosen = rng.permutation(len(pieces)).reshape(clients, per_client)
    return [np.sort(np.concatenate([pieces[i] for i in row])) for row in chosen]


def split(spec: str, labels: np.ndarray, clients: int, seed: int,
          natural: list[np.ndarray] | None = None) -> list[np.ndarray]:
    kind, value = parse(spec)
    if clients < 1:
        raise ValueError("need at least one client")
    if kind == "iid":
        return iid(labels, clients, seed)
    if kind == "dirichlet":
        return dirichlet(labels, clients, value, seed)
    if kind == "shards":
        return shards(labels, clients, int(value), seed)
    if natural is None:
        raise ValueError("partition 'natural' needs a naturally federated dataset (synthetic)")
    if len(natural) != clients:
        raise ValueError(f"the dataset has {len(natural)} natural users but {clients} clients were asked for")
    return natural
