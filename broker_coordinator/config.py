"""The coordinator's configuration file (TOML), validated at start-up.

    [federation]
    name = "default"
    model = "mnist_cnn"            # sizes message_size_limit; the model the rounds train

    [broker]
    host = "broker.example"        # the address devices connect to (goes into tokens)
    port = 1883                    # 8883 is customary with TLS
    bind = ""                      # listener address; "" = all interfaces
    tls_cert = ""                  # server certificate (PEM); TLS is on when set
    tls_key = ""
    tls_ca = ""                    # CA that signed tls_cert; its fingerprint goes into tokens
    password_file = "/etc/mosquitto/edgefl/passwd"
    acl_file = "/etc/mosquitto/edgefl/acl"
    conf_file = "/etc/mosquitto/conf.d/edgefl.conf"
    coordinator_user = "coordinator"
    coordinator_password_file = "/var/lib/edgefl-coordinator/coordinator.secret"
    pid_file = "/run/mosquitto/mosquitto.pid"   # SIGHUP goes to this pid after a credential change
    reload_command = "systemctl reload mosquitto.service"  # used when the pid file is absent or not ours to signal
    message_size_limit = 0         # bytes; 0 = sized to the model

    [registry]
    path = "/var/lib/edgefl-coordinator/registry.db"   # SQLite; the round store shares this file

    [enrollment]
    token_hours = 24.0             # how long an enrollment token stays valid

    [rounds]                       # RoundSettings (broker_coordinator/coordinator.py), same key names
    algorithm = "fedavg"
    clients_per_round = 0
    ...

Environment overrides: EDGEFL_COORDINATOR_<SECTION>_<KEY>, e.g.
EDGEFL_COORDINATOR_BROKER_PORT=1884 or EDGEFL_COORDINATOR_REGISTRY_PATH=/tmp/r.db.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgefl_protocol import topics
from edgefl_protocol.settings import ConfigError, build_section, read_toml

ENV_PREFIX = "EDGEFL_COORDINATOR"
DEFAULT_PATH = Path("/etc/edgefl/coordinator.toml")
SECTIONS = ("federation", "broker", "registry", "enrollment", "rounds")


@dataclass
class FederationSettings:
    name: str = "default"
    model: str = "mnist_cnn"

    def validate(self) -> None:
        topics.check_name("federation", self.name)


@dataclass
class BrokerSettings:
    host: str = "localhost"
    port: int = 1883
    bind: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    password_file: str = "/etc/mosquitto/edgefl/passwd"
    acl_file: str = "/etc/mosquitto/edgefl/acl"
    conf_file: str = "/etc/mosquitto/conf.d/edgefl.conf"
    coordinator_user: str = "coordinator"
    coordinator_password_file: str = "/var/lib/edgefl-coordinator/coordinator.secret"
    pid_file: str = "/run/mosquitto/mosquitto.pid"
    reload_command: str = "systemctl reload mosquitto.service"
    message_size_limit: int = 0

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both for TLS, or neither")
        if self.message_size_limit < 0:
            raise ValueError("message_size_limit must be >= 0 (0 = sized to the model)")
        topics.check_name("coordinator_user", self.coordinator_user)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


@dataclass
class RegistrySettings:
    path: str = "/var/lib/edgefl-coordinator/registry.db"


@dataclass
class EnrollmentSettings:
    token_hours: float = 24.0

    def validate(self) -> None:
        if not 0 < self.token_hours <= 24 * 30:
            raise ValueError(f"token_hours must be in (0, 720], got {self.token_hours}")


@dataclass
class CoordinatorConfig:
    federation: FederationSettings = field(default_factory=FederationSettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    enrollment: EnrollmentSettings = field(default_factory=EnrollmentSettings)
    rounds_table: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def round_settings(self) -> Any:
        """The [rounds] table as coordinator.RoundSettings (imports torch, hence not done at load)."""
        from .coordinator import RoundSettings
        return build_section(RoundSettings, self.rounds_table, f"{self.path} [rounds]", f"{ENV_PREFIX}_ROUNDS")

    def coordinator_password(self, create: bool = False) -> str:
        """The coordinator's own broker password, kept in a 0600 file beside the registry."""
        path = Path(self.broker.coordinator_password_file)
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            if not create:
                raise ConfigError(f"{path} does not exist: run 'broker-coordinator broker-config' first") from None
        except PermissionError:
            raise ConfigError(f"{path} is not readable by this user: run as root or as the coordinator's "
                              "service user") from None
        password = secrets.token_urlsafe(24)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(password + "\n")
        return password


def load_config(path: Path | str | None = None, with_rounds: bool = False) -> CoordinatorConfig:
    """Read and validate the coordinator config. A missing file at the default path means defaults;
    `with_rounds` also validates [rounds] (slow: imports torch)."""
    if path is None:
        path = Path(os.environ.get(f"{ENV_PREFIX}_CONFIG", DEFAULT_PATH))
        raw = read_toml(path) if path.exists() else {}
    else:
        path = Path(path)
        raw = read_toml(path)
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]; known sections: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}])")

    def section(cls: type, name: str) -> Any:
        return build_section(cls, raw.get(name, {}), f"{path} [{name}]", f"{ENV_PREFIX}_{name.upper()}")

    config = CoordinatorConfig(section(FederationSettings, "federation"), section(BrokerSettings, "broker"),
                               section(RegistrySettings, "registry"), section(EnrollmentSettings, "enrollment"),
                               dict(raw.get("rounds", {})), path)
    if with_rounds:
        config.round_settings()
    return config
