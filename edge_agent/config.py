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
    state_dir = "/var/lib/edgefl"
    threads = 0                 # torch threads; 0 = cores minus one, at least one (hardware.default_threads)
    signing_key = "<64 hex digits>"     # this device's HMAC-SHA256 key for its updates (from enrollment)
    data = "/var/lib/edgefl/data.npz"   # shorthand for [data] source = "npz" with holdout = 0; not with [data]

    [data]                      # optional: where the local data comes from (edge_agent/data_sources.py)
    source = "spool"            # npz | csv | images | spool
    path = "/var/lib/app/spool" # the .npz or .csv file, the image folder, or the spool directory
    label_column = "label"      # csv, and csv files in a spool: the label column; every other column is a feature
    shape = [3, 128]            # csv/spool: reshape flat feature rows to this per-sample shape ([] = as read);
                                # a spool rejects files of another shape (without it, the first file sets it)
    image_size = [28, 28]       # images: resized to height x width
    channels = 1                # images: 1 = grayscale, 3 = RGB
    window = 5000               # spool: train on the newest N samples
    consume = "move"            # spool: what happens to a file once read (see below)
    holdout = 0.2               # fraction held out for federated evaluation, never trained on
    state_dir = ""              # spool: where its cursor and window list live ("" = [device] state_dir)

    [conditions]                # optional, set by the device's owner: when it may train (edge_agent/conditions.py)
    hours = "22:00-06:00"       # local time; several as "12:00-13:00, 22:00-06:00"; "" = any time
    max_load = 1.5              # 1-minute load average per core, its own training left out; 0 = no limit
    max_temperature = 70        # degrees Celsius, the hottest /sys/class/thermal zone; 0 = no limit
    daily_cpu_seconds = 3600    # CPU-seconds of training per local day, kept across restarts; 0 = no cap

    [serving]                   # optional: the models the device's own applications use (edge_agent/serving_store.py)
    dir = "/var/lib/edgefl-serving"   # default <state_dir>/serving; "" = no serving store
    keep = 3                    # versions kept
    group = "edgefl-model"      # local group that may read the store (when it exists)
    gate = true                 # keep the current version when a new one is worse on the held-out data
    gate_margin = 0.02          # ... by more than this (metric units: 0.02 = 2 accuracy points)
    personalize = "off"         # prior: the device's label frequencies; tune: personalize_steps SGD steps

A spool is a directory the device's own application writes small `.npz` (x, y)
or `.csv` batches into, each under a unique name by atomic rename (write
`name.tmp` or `.name`, then rename; those are ignored). Each round the agent
reads only files it has not seen (a backlog newest first, only as far as the
window reaches), keeps the newest `window` samples, and skips
a broken file with one logged line (moved to `rejected/` unless consume =
"keep"). consume = "move" (default) moves read files into `consumed/`, so a
round lists only new files and restarts find only new ones; "delete" also
moves them there, then deletes each once its samples leave the window (disk
bounded by the window); "keep" leaves them in place and remembers a cursor (a
round then lists the whole directory). The window is restored after a restart
by re-reading the files named in `<state_dir>/spool.msgpack`.

Holdout is a stable per-sample draw (a hash of file name and row, or of the
index for a fixed file), so a held-out sample never trains later.

A device that may not train now (outside its hours, over a threshold, or
over its daily CPU-seconds) says why in its status, is not selected, and
refuses a task that arrives anyway; a training that has started finishes.
Every condition is off by default.

Environment overrides: EDGEFL_AGENT_BROKER_HOST, EDGEFL_AGENT_DEVICE_THREADS,
EDGEFL_AGENT_DATA_WINDOW, ... (a list as "3,128").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from edgefl_protocol import signing, topics
from edgefl_protocol.settings import ConfigError, build_section, read_toml

from .conditions import Hours

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
    state_dir: str
    data: str = ""  # legacy shorthand for [data] source = "npz"
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


SOURCES = ("npz", "csv", "images", "spool")
CONSUME = ("move", "delete", "keep")


def _int_list(value: object, key: str) -> tuple[int, ...]:
    """A TOML list of positive ints, or "3,128" / "[3, 128]" from an environment variable."""
    if isinstance(value, str):
        text = value.strip().strip("[]").strip()
        try:
            value = [int(part) for part in text.split(",")] if text else []
        except ValueError:
            raise ValueError(f"{key} must be a list of positive integers like [3, 128], got {value!r}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                       for v in value):
        raise ValueError(f"{key} must be a list of positive integers like [3, 128], got {value!r}")
    return tuple(value)


@dataclass
class DataSettings:
    source: str = "npz"
    path: str = ""
    label_column: str = "label"
    shape: tuple[int, ...] = ()  # per-sample shape for flat csv rows; () = keep as read
    image_size: tuple[int, ...] = (28, 28)
    channels: int = 1
    window: int = 5000
    consume: str = "move"
    holdout: float = 0.2
    state_dir: str = ""  # spool bookkeeping; filled from [device] state_dir when empty

    def validate(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if not self.path:
            raise ValueError("path is required: the data file, image folder or spool directory")
        self.shape = _int_list(self.shape, "shape")
        self.image_size = _int_list(self.image_size, "image_size")
        if len(self.image_size) != 2:
            raise ValueError(f"image_size must be [height, width], got {list(self.image_size)}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {self.channels}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1 sample, got {self.window}")
        if self.consume not in CONSUME:
            raise ValueError(f"consume must be one of {', '.join(CONSUME)}, got {self.consume!r}")
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"holdout must be a fraction in [0, 1), got {self.holdout}")
        if not self.label_column:
            raise ValueError("label_column must name the csv column that holds the labels")


@dataclass
class ConditionsSettings:
    hours: str = ""  # local times it may train, e.g. "22:00-06:00" or "12:00-13:00, 22:00-06:00"
                     # (a range may cross midnight); "" = any time
    max_load: float = 0.0  # no training starts while the 1-minute load average per core, less its own
                           # training's share, is above this; 0 = no limit
    max_temperature: float = 0.0  # degrees Celsius: no training starts while the hottest /sys/class/thermal
                                  # zone is above this; 0 = no limit (nor on a board without a sensor)
    daily_cpu_seconds: float = 0.0  # CPU-seconds (all its threads) it may train per local day, counted
                                    # across restarts, checked before a task starts; 0 = no cap

    def validate(self) -> None:
        Hours(self.hours)  # raises ValueError naming `hours`
        for name in ("max_load", "max_temperature", "daily_cpu_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (off) or positive, got {getattr(self, name)}")
        if self.max_temperature > 150:
            raise ValueError(f"max_temperature is in degrees Celsius (e.g. 70), got {self.max_temperature:g}")


SERVING_DEFAULT_DIR = "<state_dir>/serving"


@dataclass
class ServingSettings:
    dir: str = SERVING_DEFAULT_DIR  # the serving store: one directory per version and a `current` link; "" = off
    keep: int = 3  # the newest N versions kept (the current one always)
    group: str = ""  # local group whose members (the device's applications) may read the store, when it exists
    gate: bool = True  # before publishing a version, score it on the held-out data and keep the current one when worse
    gate_margin: float = 0.02  # gate: how much worse (in the metric's units; 0.02 = 2 accuracy points) is refused
    personalize: str = "off"  # opt-in: prior (the device's label frequencies) | tune (SGD steps) on a copy of each release
    personalize_steps: int = 60  # personalize = "tune": SGD steps of the copy on the device's own data
    personalize_lr: float = 0.01  # personalize = "tune": the copy's learning rate (momentum 0.9, batches of 32)

    def validate(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1 version, got {self.keep}")
        if self.gate_margin < 0:
            raise ValueError(f"gate_margin must be 0 or positive, got {self.gate_margin}")
        if self.personalize not in ("off", "prior", "tune"):
            raise ValueError(f"personalize must be off, prior or tune, got {self.personalize!r}")
        if self.personalize_steps < 1 or self.personalize_steps > 100_000:
            raise ValueError(f"personalize_steps must be 1 to 100000, got {self.personalize_steps}")
        if not 0 < self.personalize_lr < 10:
            raise ValueError(f"personalize_lr must be positive and below 10, got {self.personalize_lr}")


@dataclass
class AgentConfig:
    broker: BrokerSettings
    device: DeviceSettings
    path: Path
    data: DataSettings  # from [data], or from the legacy [device] data
    conditions: ConditionsSettings = field(default_factory=ConditionsSettings)  # the owner's [conditions]
    serving: ServingSettings = field(default_factory=ServingSettings)  # the device's [serving] store


def _data_settings(raw: dict, device: DeviceSettings, path: Path) -> DataSettings:
    """[data], or the legacy [device] data (an npz trained on whole, as before); never both."""
    env = f"{ENV_PREFIX}_DATA"
    has_section = "data" in raw or any(name.startswith(env + "_") for name in os.environ)
    if has_section and device.data:
        raise ConfigError(f"{path}: both [device] data and [data] (a section, or {env}_* variables) are set; "
                          f"move the path to [data] path and remove [device] data")
    if has_section:
        data = build_section(DataSettings, raw.get("data", {}), f"{path} [data]", env)
    elif device.data:
        data = build_section(DataSettings, {"source": "npz", "path": device.data, "holdout": 0.0},
                             f"{path} [device] data")
    else:
        raise ConfigError(f"{path}: no local data configured: add a [data] section with source and path "
                          f"(or [device] data = \"file.npz\")")
    data.state_dir = data.state_dir or device.state_dir
    return data


def load_config(path: Path | str) -> AgentConfig:
    path = Path(path)
    raw = read_toml(path)
    for section in raw:
        if section not in ("broker", "device", "data", "conditions", "serving"):
            raise ConfigError(f"{path}: unknown section [{section}]; expected [broker], [device], [data], "
                              "[conditions] and [serving]")
    broker = build_section(BrokerSettings, raw.get("broker", {}), f"{path} [broker]", f"{ENV_PREFIX}_BROKER")
    device = build_section(DeviceSettings, raw.get("device", {}), f"{path} [device]", f"{ENV_PREFIX}_DEVICE")
    conditions = build_section(ConditionsSettings, raw.get("conditions", {}), f"{path} [conditions]",
                               f"{ENV_PREFIX}_CONDITIONS")
    serving = build_section(ServingSettings, raw.get("serving", {}), f"{path} [serving]", f"{ENV_PREFIX}_SERVING")
    if serving.dir == SERVING_DEFAULT_DIR:
        serving.dir = str(Path(device.state_dir) / "serving")
    return AgentConfig(broker, device, path, _data_settings(raw, device, path), conditions, serving)
