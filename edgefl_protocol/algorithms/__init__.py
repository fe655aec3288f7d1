"""Federated algorithms: one module each, client rule and server rule together."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from . import fedavg
from .base import ClientRule, ServerRule


@dataclass(frozen=True)
class Algorithm:
    name: str
    client: type[ClientRule]
    server: type[ServerRule]
    defaults: dict[str, float]
    module: ModuleType


ALGORITHMS: dict[str, Algorithm] = {
    m.NAME: Algorithm(m.NAME, m.FedAvgClient, m.FedAvgServer, m.DEFAULT_HPARAMS, m) for m in (fedavg,)
}
DEFAULT_ALGORITHM = "fedavg"


def get(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}") from None
