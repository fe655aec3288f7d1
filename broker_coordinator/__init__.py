"""The coordinator side of EdgeFL, in layers (top to bottom): `cli`; `simulation`; `engine`;
`aggregation`, `access`, `storage`, `reporting`; `settings`. A layer imports only the layers
below it; `pyproject.toml` writes this down as import-linter contracts, checked by `make test`.
"""

import os

# Before numpy loads: the coordinator folds one update at a time (80k-1M values), where numpy's
# OpenBLAS threads gain nothing, and their spin-waiting nearly doubled its CPU per update (4.3 ->
# 2.3 ms for the MNIST CNN in process; bench/results/runtime.json has the broker-to-fold numbers).
# An operator's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
