"""Federated algorithms: one module each, client rule and server rule together.

Every module defines NAME, DEFAULT_HPARAMS, `Client` (a ClientRule) and
`Server` (a ServerRule); `docs/ALGORITHMS.md` compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from . import drsam, dynsam, fedavg, feddyn, fedprox, fedsam, fedsmoo
from .base import ClientRule, ServerRule


@dataclass(frozen=True)
class Algorithm:
    name: str
    client: type[ClientRule]
    server: type[ServerRule]
    defaults: dict[str, float | str]
    module: ModuleType


ALGORITHMS: dict[str, Algorithm] = {
    m.NAME: Algorithm(m.NAME, m.Client, m.Server, m.DEFAULT_HPARAMS, m)
    for m in (fedavg, fedprox, fedsam, feddyn, fedsmoo, drsam, dynsam)
}
DEFAULT_ALGORITHM = "dynsam"  # the field benchmark's winner (bench/results/field.md, README "Field benchmark")


def get(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}") from None
