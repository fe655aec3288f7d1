"""The agent's configuration file (TOML), validated at start-up.

    [broker]
    host = "broker.example"     # the coordinator's Mosquitto
    port = 1883
    username = "pi-07"          # broker user; the same as the device id
    password = "..."
    tls_ca = ""                 # CA certificate (PEM); TLS is on when set (written by `edge-agent enroll`)

    [device]
    id = "pi-07"
    federation = "default"
    data = "/var/lib/edgefl/data.npz"   # local data: arrays x and y
    state_dir = "/var/lib/edgefl"
    threads = 0                 # torch threads; 0 = cores minus one, at least one (hardware.default_threads)
    signing_key = "<64 hex digits>"     # this device's HMAC-SHA256 key for its updates (from enrollment)

Environment overrides: EDGEFL_AGENT_BROKER_HOST, EDGEFL_AGENT_DEVICE_THREADS, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgefl_protocol import signing, topics
from edgefl_protocol.settings import ConfigError, build_section, read_toml

ENV_PREFIX = "EDGEFL_AGENT"


@dataclass
class BrokerSettings:
    host: str
    port: int
    username: str
    password: str
    keepalive: int = 60
    tls_ca: str = ""  # CA certificate file; set = TLS to the broker, verified against it

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.keepalive < 5:
            raise ValueError(f"keepalive must be at least 5 seconds, got {self.keepalive}")


@dataclass
class DeviceSettings:
    id: str
    data: str
    state_dir: str
    federation: str = "default"
    threads: int = 0
    signing_key: str = ""  # hex; HMAC-SHA256 key for this device's updates (written by `edge-agent enroll`)

    def validate(self) -> None:
        topics.check_name("device", self.id)
        if self.signing_key:
            signing.key_from_hex(self.signing_key)
        topics.check_name("federation", self.federation)
        if self.threads < 0:
            raise ValueError(f"threads must be 0 (automatic) or positive, got {self.threads}")


@dataclass
class AgentConfig:
    broker: BrokerSettings
    device: DeviceSettings
    path: Path

    @property
    def data(self) -> "DataSettings":
        from .data_sources import DataSettings
        return DataSettings("npz", self.device.data)


def load_config(path: Path | str) -> AgentConfig:
    path = Path(path)
    raw = read_toml(path)
    for section in raw:
        if section not in ("broker", "device"):
            raise ConfigError(f"{path}: unknown section [{section}]; expected [broker] and [device]")
    broker = build_section(BrokerSettings, raw.get("broker", {}), f"{path} [broker]", f"{ENV_PREFIX}_BROKER")
    device = build_section(DeviceSettings, raw.get("device", {}), f"{path} [device]", f"{ENV_PREFIX}_DEVICE")
    return AgentConfig(broker, device, path)
