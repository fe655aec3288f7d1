"""The benchmark's federations: the headline partition file and the two other settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgefl_models import datasets, partition

from .fedsim import Federation

HEADLINE_FILE = Path(__file__).resolve().parent / "data" / "mnist5k_dir01_20clients.npz"
HEADLINE = "mnist5k_dirichlet0.1_20clients"
DIRICHLET05 = "mnist5k_dirichlet0.5_20clients"
SYNTHETIC = "synthetic1,1_30clients"
DIGITS_LABEL_SKEW = "digits_shards2_20clients"


def headline() -> Federation:
    """MNIST-5k, 20 clients, Dirichlet(0.1): the partition of bench/data (DRSAM.md section 8)."""
    data = datasets.load_mnist5k()
    with np.load(HEADLINE_FILE) as f:
        assert np.array_equal(f["shuffle_perm"], datasets.mnist_split_perm()), "split order differs from bench/data"
        train_idx, offsets = f["train_idx"], f["offsets"]
    clients = [data.train.subset(train_idx[offsets[k]:offsets[k + 1]]) for k in range(len(offsets) - 1)]
    return Federation(HEADLINE, "mnist_cnn", clients, data.test, rounds=40, clients_per_round=10)


def dirichlet05() -> Federation:
    data = datasets.load_mnist5k()
    parts = partition.dirichlet(data.train.y, 20, 0.5, seed=0)
    return Federation(DIRICHLET05, "mnist_cnn", [data.train.subset(p) for p in parts], data.test,
                      rounds=40, clients_per_round=10)


def synthetic() -> Federation:
    data = datasets.load_synthetic(1.0, 1.0, num_users=30, seed=0)
    clients = [data.train.subset(s) for s in data.natural_shards]
    return Federation(SYNTHETIC, "logreg60", clients, data.test, rounds=40, clients_per_round=10)


def digits_label_skew() -> Federation:
    """scikit-learn's digits over 20 clients, each holding 2 label-sorted shards (McMahan et al.'s
    pathological split): most clients see two classes, the harshest label skew of the settings."""
    data = datasets.load_digits()
    parts = partition.shards(data.train.y, 20, 2, seed=0)
    return Federation(DIGITS_LABEL_SKEW, "digits_mlp", [data.train.subset(p) for p in parts], data.test,
                      rounds=40, clients_per_round=10)


SETTINGS = {HEADLINE: headline, DIRICHLET05: dirichlet05, SYNTHETIC: synthetic, DIGITS_LABEL_SKEW: digits_label_skew}
