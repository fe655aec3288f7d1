"""The coordinator's configuration file (TOML), validated at start-up.

    [federation]
    name = "default"
    model = "mnist_cnn"                  # an architecture from models.architectures
    test_data = "/var/lib/edgefl-coordinator/test.npz"   # held-out set (arrays x, y)
    rounds = 0                           # 0 = run until stopped
    seed = 0

    [broker]
    host = "127.0.0.1"
    port = 1883
    username = "coordinator"
    password = "..."

    [rounds]                             # every field of coordinator.RoundSettings
    clients_per_round = 10
    min_updates = 5
    round_timeout = 300.0
    local_epochs = 0                     # 0 = devices choose from their speed and the deadline

    [storage]
    state_dir = "/var/lib/edgefl-coordinator"

    [metrics]
    port = 9464                          # Prometheus endpoint; 0 = off
    bind = "127.0.0.1"

Environment overrides: EDGEFL_COORDINATOR_<SECTION>_<KEY>, e.g.
EDGEFL_COORDINATOR_BROKER_PASSWORD.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgefl_protocol import topics
from edgefl_protocol.settings import ConfigError, build_section, read_toml
from models.architectures import ARCHITECTURES

from .coordinator import RoundSettings

ENV_PREFIX = "EDGEFL_COORDINATOR"


@dataclass
class FederationSettings:
    test_data: str
    name: str = "default"
    model: str = "mnist_cnn"
    rounds: int = 0
    seed: int = 0

    def validate(self) -> None:
        topics.check_name("federation", self.name)
        if self.model not in ARCHITECTURES:
            raise ValueError(f"model must be one of {', '.join(ARCHITECTURES)}, got {self.model!r}")
        if self.rounds < 0:
            raise ValueError("rounds must be >= 0 (0 = run until stopped)")


@dataclass
class CoordinatorBroker:
    password: str
    host: str = "127.0.0.1"
    port: int = 1883
    username: str = "coordinator"
    keepalive: int = 60

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")


@dataclass
class StorageSettings:
    state_dir: str = "/var/lib/edgefl-coordinator"


@dataclass
class MetricsSettings:
    port: int = 0
    bind: str = "127.0.0.1"

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be 0 (off) or 1-65535, got {self.port}")


@dataclass
class CoordinatorConfig:
    federation: FederationSettings
    broker: CoordinatorBroker
    rounds: RoundSettings
    storage: StorageSettings
    metrics: MetricsSettings
    path: Path


SECTIONS = {"federation": FederationSettings, "broker": CoordinatorBroker, "rounds": RoundSettings,
            "storage": StorageSettings, "metrics": MetricsSettings}


def load_config(path: Path | str) -> CoordinatorConfig:
    path = Path(path)
    raw = read_toml(path)
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}; "
                          f"expected {', '.join(SECTIONS)}")
    built = {name: build_section(cls, raw.get(name, {}), f"{path} [{name}]", f"{ENV_PREFIX}_{name}")
             for name, cls in SECTIONS.items()}
    return CoordinatorConfig(**built, path=path)
