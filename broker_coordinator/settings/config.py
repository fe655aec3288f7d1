"""The coordinator's configuration file (TOML), validated at start-up.

    [federation]
    name = "default"
    model = "mnist_cnn"                  # a built-in (edgefl_models.architectures) or your own: "package.module:factory"
    task = "classification"              # classification | regression
    loss = ""                            # regression: mse (default) | mae; classification: cross_entropy
    test_data = "/var/lib/edgefl-coordinator/test.npz"   # held-out set (arrays x, y); "" = none: the devices
                                         # evaluate on their held-out slices ([evaluation] evaluate)
    rounds = 0                           # 0 = run until stopped
    seed = 0
    root_data = ""                       # trusted (x, y) for root_trust / reference = "root"; never the test set
    min_protocol = 1                     # the oldest protocol version served (1: agents of 0.1.0 train too)

    [broker]
    host = "127.0.0.1"                   # where the coordinator itself connects
    port = 1883
    username = "coordinator"
    password = "..."                     # the coordinator's own broker password
    # what devices are told (enrollment tokens) and what `broker-config` writes:
    device_host = "broker.example"       # the address devices connect to; "" = host
    device_port = 0                      # the devices' listener; 0 = port. With TLS: e.g. 8883,
                                         # and `port` stays a plain listener on 127.0.0.1 for the coordinator
    bind = ""                            # the devices' listener address; "" = all interfaces
    tls_cert = ""                        # server certificate (PEM); TLS on the devices' listener when set
    tls_key = ""
    tls_ca = ""                          # CA that signed tls_cert ("" = tls_cert is self-signed);
                                         # its SHA-256 fingerprint goes into enrollment tokens
    passwd_file = "/etc/mosquitto/edgefl/passwd"
    acl_file = "/etc/mosquitto/edgefl/acl"
    conf_file = "/etc/mosquitto/conf.d/edgefl.conf"
    pid_file = "/run/mosquitto/mosquitto.pid"   # SIGHUP goes to this pid after a credential change...
    reload_command = "systemctl reload mosquitto.service"  # ...or this runs, if the pid is not ours to signal
    message_size_limit = 0               # bytes; 0 = sized to the model

    # how rounds run, one section per concern (round_sections.py has every key, its default and
    # what it does; in 0.1 they all sat in [rounds], which still works: round_config.py)
    [schedule]
    mode = "sync"                        # sync | buffered (FedBuff-style versions: buffer_size, max_staleness, ...)
    clients_per_round = 10               # 0 (the default): every eligible device
    min_updates = 1                      # quorum to close a round at its deadline
    round_timeout = 300.0

    [algorithm]
    algorithm = "dynsam"                 # the client and server rule (docs/ALGORITHMS.md)
    local_epochs = 0                     # 0 = devices choose from their speed and the deadline
    hparams = { dual_decay = 1.0 }       # the algorithm's own hyper-parameters, over its defaults

    [fold]
    aggregator = "centered_clip"         # centered_clip | mean (streaming) | gated_mean | trimmed_mean | median | geomed
    weighting = "capped"                 # capped | uniform | reported: what a device's sample count may weigh
    norm_bound = 1.5                     # clip updates to this x the median norm of recent ones (0 = off)
    sign_quorum = 0.0                    # > 0: a parameter moves only where this share of a round's updates agree
                                         # on its sign (against backdoors; costs accuracy on small models: RESEARCH.md)
    kinship = 0.0                        # centered_clip: > 0 (0.4 measured) flags devices whose updates depart alike
                                         # (path cosine above this); off: it stopped no backdoor (RESEARCH.md)
    agreement_floor = 0.0                # centered_clip: flag an update as pointing away only below -this median
                                         # cosine (0.05 measured: fewer honest flags; RESEARCH.md)
    agreement_flags = 1                  # centered_clip: flags in a device's last 5 judged updates before its
                                         # weight falls (2: spares devices of skewed data; RESEARCH.md)
    verdict_banks = 0                    # centered_clip: > 0 (8 measured) lets a round's flags hold back its own
                                         # updates, at the price of their bank-mates; memory this x model

    [server_optimizer]
    server_optimizer = "sgd"             # sgd | momentum | adam | yogi | adagrad, on the fold's step

    [transfer]
    codec = "auto"                       # the devices' uplink codec
    downlink = "full"                    # full | delta (lossy deltas to devices holding a recent model)

    [evaluation]
    evaluate = "auto"                    # central | devices | both | auto (central when test_data is set)
    serve_average = 0.75                 # evaluate/keep/serve an average of the global models (0 = the last one)

    [privacy]                            # user-level differential privacy (settings/privacy_settings.py)
    mode = "off"                         # off | central

    [pacing]                             # when rounds open, and when the fleet rests (pacing_settings.py)
    interval = "10m"                     # from one round's start to the next; 0 = back to back
    patience = 10                        # evaluations without improvement before the federation rests; 0 = never

    [storage]
    state_dir = "/var/lib/edgefl-coordinator"   # the device registry, the tasks and their checkpoints (OPERATOR.md)
    keep_checkpoints = 10                # the last N rounds' models, for `broker-coordinator rollback`

    [enrollment]
    token_hours = 24.0                   # how long an enrollment token stays valid

    [metrics]
    port = 0                             # Prometheus endpoint, e.g. 9464; 0 (the default) = off
    bind = "127.0.0.1"

    [tracking]                           # optional: each round to TensorBoard and/or MLflow (tracking_settings.py)
    tensorboard = "/var/lib/edgefl-coordinator/tensorboard"
    mlflow = "file:/var/lib/edgefl-coordinator/mlruns"

    [sites.north]                        # optional: the federation in sites (see broker_coordinator/access/sites.py)
    devices = "north-*"                  # glob patterns over device ids, comma-separated
    workers = 1                          # site aggregator processes sharing the site's updates
    host = "site-north.example"          # the site broker, as its devices and workers reach it
    port = 1883
    bridge_tls = "auto"                  # auto = TLS when this broker has TLS | on | off

Environment overrides: EDGEFL_COORDINATOR_<SECTION>_<KEY>, e.g.
EDGEFL_COORDINATOR_BROKER_PASSWORD or EDGEFL_COORDINATOR_FOLD_NORM_BOUND.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker_coordinator.settings import composition
from broker_coordinator.settings.pacing_settings import PacingSettings
from broker_coordinator.settings.serving_settings import ServingSettings
from broker_coordinator.settings.site_settings import SiteSettings
from broker_coordinator.settings.tracking_settings import TrackingSettings
from edgefl_protocol import OLDEST_SCHEMA, protocol, topics
from edgefl_protocol.settings import ConfigError, build_section, read_toml

ENV_PREFIX = "EDGEFL_COORDINATOR"
DEFAULT_PATH = Path("/etc/edgefl/coordinator.toml")
REGISTRY_FILE = "coordinator.db"


@dataclass
class FederationSettings:
    test_data: str = ""
    name: str = "default"
    model: str = "mnist_cnn"
    task: str = "classification"
    loss: str = ""  # "" = the task's default: cross_entropy, or mse for regression
    rounds: int = 0
    seed: int = 0
    root_data: str = ""  # a small trusted labelled set (x, y) (.npz), for [fold] root_trust and reference = "root"; never the test set
    min_protocol: int = OLDEST_SCHEMA  # the oldest protocol version served: agents that speak only older ones are told to upgrade

    def validate(self) -> None:
        topics.check_name("federation", self.name)
        protocol.serves(self.min_protocol)  # raises ValueError naming the versions this release speaks
        from edgefl_models.objectives import Objective
        Objective.of(self.task, self.loss)  # raises ValueError naming the task or the loss
        if self.rounds < 0:
            raise ValueError("rounds must be >= 0 (0 = run until stopped)")


@dataclass
class CoordinatorBroker:
    password: str
    host: str = "127.0.0.1"
    port: int = 1883
    username: str = "coordinator"
    keepalive: int = 60
    device_host: str = ""
    device_port: int = 0
    bind: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    passwd_file: str = "/etc/mosquitto/edgefl/passwd"
    acl_file: str = "/etc/mosquitto/edgefl/acl"
    conf_file: str = "/etc/mosquitto/conf.d/edgefl.conf"
    pid_file: str = "/run/mosquitto/mosquitto.pid"
    reload_command: str = "systemctl reload mosquitto.service"
    message_size_limit: int = 0

    def validate(self) -> None:
        for name in ("port", "device_port"):
            value = getattr(self, name)
            if not (0 < value < 65536 or (name == "device_port" and value == 0)):
                raise ValueError(f"{name} must be 1-65535, got {value}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both for TLS, or neither")
        if self.tls_cert and self.devices_port == self.port:
            raise ValueError("with TLS, set device_port (e.g. 8883) for the devices' TLS listener; `port` stays "
                             "a plain listener on 127.0.0.1 for the coordinator")
        if self.message_size_limit < 0:
            raise ValueError("message_size_limit must be >= 0 (0 = sized to the model)")
        topics.check_name("username", self.username)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def devices_host(self) -> str:
        return self.device_host or self.host

    @property
    def devices_port(self) -> int:
        return self.device_port or self.port


@dataclass
class StorageSettings:
    state_dir: str = "/var/lib/edgefl-coordinator"
    keep_checkpoints: int = 10  # the last N rounds' checkpoints, for `broker-coordinator rollback`

    def validate(self) -> None:
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0 (0 = keep only the live one), got {self.keep_checkpoints}")


@dataclass
class EnrollmentSettings:
    token_hours: float = 24.0

    def validate(self) -> None:
        if not 0 < self.token_hours <= 24 * 30:
            raise ValueError(f"token_hours must be in (0, 720], got {self.token_hours}")


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
    rounds: Any  # RoundSettings, from the round sections; None when loaded with with_rounds=False
    storage: StorageSettings
    enrollment: EnrollmentSettings
    metrics: MetricsSettings
    path: Path
    sites: dict[str, SiteSettings] = field(default_factory=dict)  # empty: a flat federation
    tracking: TrackingSettings = field(default_factory=TrackingSettings)  # off unless a key is set
    pacing: PacingSettings = field(default_factory=PacingSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)

    @property
    def registry_path(self) -> Path:
        return Path(self.storage.state_dir) / REGISTRY_FILE


# the round sections are round_sections.ROUND_SECTIONS and [privacy] (not imported here: they import torch);
# [rounds] is the round keys' old place (round_config.py)
SECTIONS = ("federation", "broker", "schedule", "algorithm", "fold", "server_optimizer", "transfer", "evaluation",
            "privacy", "pacing", "serving", "storage", "enrollment", "metrics", "sites", "tracking", "rounds")


def load_config(path: Path | str, with_rounds: bool = True) -> CoordinatorConfig:
    """Read and validate the config. `with_rounds=False` skips the round sections ([schedule] ...
    [privacy], and the old [rounds]) and the model check, which import torch; the device-management
    commands use it to stay quick."""
    path = Path(path)
    raw = read_toml(path)
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}; "
                          f"expected {', '.join(SECTIONS)}")
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name} must be a table ([{name}])")

    def section(cls: type, name: str) -> Any:
        return build_section(cls, raw.get(name, {}), f"{path} [{name}]", f"{ENV_PREFIX}_{name}")

    rounds = None
    federation = section(FederationSettings, "federation")
    if with_rounds:
        from broker_coordinator.settings.round_config import read_rounds
        from edgefl_models.architectures import ModelError, resolve
        try:
            resolve(federation.model)
        except ModelError as exc:
            raise ConfigError(f"{path} [federation] model: {exc}") from None
        rounds = read_rounds(raw, str(path), ENV_PREFIX)
        try:
            rounds.evaluation(bool(federation.test_data))
        except ValueError as exc:
            raise ConfigError(f"{path} [evaluation]: {exc}") from None
    sites = {}
    for name, table in raw.get("sites", {}).items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: sites.{name} must be a table ([sites.{name}])")
        sites[name] = build_section(SiteSettings, {"name": name, **table}, f"{path} [sites.{name}]")
    if sites and rounds is not None:
        try:
            composition.check(rounds, "sites")
        except ValueError as exc:
            raise ConfigError(f"{path} with [sites.*]: {exc}") from None
    return CoordinatorConfig(federation, section(CoordinatorBroker, "broker"), rounds,
                             section(StorageSettings, "storage"), section(EnrollmentSettings, "enrollment"),
                             section(MetricsSettings, "metrics"), path, sites,
                             tracking=section(TrackingSettings, "tracking"), pacing=section(PacingSettings, "pacing"),
                             serving=section(ServingSettings, "serving"))
