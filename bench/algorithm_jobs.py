"""What one run of the algorithm benchmark is (a `Variant` on a setting, with an optimizer and a
seed: a `Job`) and where its result is cached; shared by `algorithms` and research/'s `tuning` and `mqtt_check`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PIPELINE = "shipped_fold"  # a new name whenever what a cached run measured changes
RUNS = RESULTS / "algorithms_runs" / PIPELINE
MOMENTUM = 0.9


@dataclass(frozen=True)
class Variant:
    """One row of the table: an algorithm with hyper-parameter overrides."""

    name: str
    algorithm: str
    hparams: tuple[tuple[str, float | str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Job:
    setting: str
    variant: Variant
    momentum: float
    seed: int
    split: str = "test"       # "test" or "validation"
    rounds: int | None = None
    server: str = ""          # [rounds] server_optimizer; "" is the default (sgd at rate 1)
    host_speed: float = 0.0   # samples/CPU-s an emulated device's class speed multiplies; 0: the pinned one
    pipeline: str = PIPELINE  # the cache directory: runs in another pipeline measured something else

    @property
    def key(self) -> str:
        # "server-" keeps a server optimizer's name apart from the client's momentum ("dynsam+momentum")
        return self.variant.name + ("+momentum" if self.momentum else "") + (f"+server-{self.server}" if self.server else "")

    @property
    def path(self) -> Path:
        split = f"{self.split}_r{self.rounds}" if self.rounds else self.split
        return RESULTS / "algorithms_runs" / self.pipeline / split / self.setting / f"{self.key}_s{self.seed}.json"
