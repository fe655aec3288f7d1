"""The coordinator side of EdgeFL, in layers (top to bottom): `cli`; `simulation`; `engine`;
`aggregation`, `access`, `storage`, `reporting`; `settings`. A layer imports only the layers
below it; `pyproject.toml` writes this down as import-linter contracts, checked by `make test`.
"""
