"""The `[tracking]` section of the coordinator's config: where a run's rounds are written for the
researcher's own tools (TensorBoard, MLflow; `broker_coordinator/reporting/tracking.py` writes them).

    [tracking]
    tensorboard = "/var/lib/edgefl-coordinator/tensorboard"   # a directory; each run in its own subdirectory
    mlflow = "file:/var/lib/edgefl-coordinator/mlruns"         # a tracking URI: file:DIR or http(s)://server
    experiment = ""                                            # MLflow experiment; "" = the federation's name
    run_name = ""                                              # "" = <federation>-<start time>

Both are optional extras (`pip install edgefl[tracking]`: the tensorboard and mlflow-skinny
packages); a key set without its package is refused at start-up.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

EXTRA = "pip install edgefl[tracking]"
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # key -> the module its package installs


@dataclass
class TrackingSettings:
    tensorboard: str = ""
    mlflow: str = ""
    experiment: str = ""
    run_name: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard or self.mlflow)

    def validate(self) -> None:
        if self.mlflow and not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", self.mlflow):
            raise ValueError(f"mlflow must be a tracking URI, e.g. file:/var/lib/edgefl-coordinator/mlruns or "
                             f"http://mlflow.example:5000, got {self.mlflow!r}")
        for key, module in PACKAGES.items():
            if getattr(self, key) and importlib.util.find_spec(module) is None:
                raise ValueError(f"{key} = {getattr(self, key)!r} needs the {module} package, which is not "
                                 f"installed: {EXTRA}")
