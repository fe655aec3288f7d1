"""Where a result came from: every JSON in `bench/results/` carries a top-level `measured_with`.

    measured_with(command, settings, **extra) -> {"commit": ..., "command": ..., **settings, **extra}
    defaults() -> today's shipped values of the settings that decide a result
    deciding(round_settings, topology) -> the same keys, read from any RoundSettings
    invoked() -> this process's command line, as "python -m bench.NAME ARGS"

`commit` is the short sha of this checkout's HEAD, with "+dirty" when tracked files outside
`bench/results/` differ from it (the run measured code that no commit holds). `settings` uses the key names of `defaults()`
so that `tests/test_provenance.py` can compare a file that claims to describe the defaults
with what ships today, key by key:

    algorithm     the algorithm's name (edgefl_protocol/algorithms)
    momentum      the client optimizer's momentum (0.0: plain SGD)
    local_epochs  the local-epoch policy: N fixed epochs, 0 = each device chooses
    codec         the uplink codec: "auto" (the default: edgefl_protocol.codec.resolve picks it by
                  model size), or the one a file named; a file that records a named codec may also
                  record `model_values`, the parameter counts of the models it measured, so that
                  the named codec can be checked against what "auto" resolves to on each
    downlink      "full" or "delta"
    aggregator    the coordinator's fold (broker_coordinator/aggregation/robust.py)
    weighting     what a device's sample count may weigh (broker_coordinator/aggregation/trust.py)
    norm_bound    deltas clipped to this times the median recent norm; 0 = off
    kinship       centered_clip's kinship threshold (aggregation/consensus.py); 0 = off
    agreement_floor  centered_clip's margin below 0 for an agreement flag (aggregation/consensus.py)
    serve_average the decay of the served (and evaluated) average of the global models; 0 = the last model
    verdict_banks centered_clip's partial sums that let a round's flags reach its own updates; 0 = off
    mode          "sync" or "buffered"
    topology      "flat" or "sites"
    server_optimizer  the server optimizer (sgd | momentum | adam | yogi | adagrad)
    server_lr     its rate (1.0 with sgd: the server rule's own step)

A setting that a file varies across its rows goes under `extra` as `varies={key: [values]}`
(and not at the top level); one that cannot be known for an old file is "unknown".
Other keys (data, partition, seeds, ...) are free-form.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def defaults() -> dict[str, Any]:
    """The shipped defaults of the settings that decide a result, read from the code (never copied)."""
    from broker_coordinator.settings.config import CoordinatorConfig
    from broker_coordinator.settings.round_settings import RoundSettings

    sites = CoordinatorConfig.__dataclass_fields__["sites"].default_factory()
    return deciding(RoundSettings(), "sites" if sites else "flat")


def deciding(rounds: Any, topology: str = "flat") -> dict[str, Any]:
    """The deciding settings of one `RoundSettings`, under the key names of `defaults()`."""
    return {
        "algorithm": rounds.algorithm,
        "momentum": rounds.momentum,
        "local_epochs": rounds.local_epochs,
        "codec": rounds.codec,
        "downlink": rounds.downlink,
        "aggregator": rounds.aggregator,
        "weighting": rounds.weighting,
        "norm_bound": rounds.norm_bound,
        "kinship": rounds.kinship,
        "agreement_floor": rounds.agreement_floor,
        "serve_average": rounds.serve_average,
        "verdict_banks": rounds.verdict_banks,
        "mode": rounds.mode,
        "topology": topology,
        "server_optimizer": rounds.server_optimizer,
        "server_lr": rounds.server_step_size(),
        "server_lr_decay": rounds.server_lr_decay,
    }


def commit() -> str:
    """HEAD's short sha, "+dirty" when tracked files other than the results differ from it;
    "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def portable(arg: str) -> str:
    """A path inside this checkout as a path relative to it (results never name this machine's paths)."""
    if not arg.startswith("/"):
        return arg
    try:
        return str(Path(arg).resolve().relative_to(ROOT))
    except ValueError:
        return arg


def invoked() -> str:
    """How this process was started, as a command to rerun: "python -m bench.field --quick"."""
    script = Path(sys.argv[0]).resolve()
    args = [shlex.quote(portable(a)) for a in sys.argv[1:]]  # quoted: an argument with spaces reruns as one
    try:
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        return " ".join(["python", sys.argv[0], *args])
    return " ".join(["python", "-m", module, *args])


def codecs_of(archs: list[str], configured: str | None = None) -> dict[str, str]:
    """{arch: the uplink codec it travels in} for a configured codec (the default: RoundSettings'),
    "auto" resolved by each model's size as the coordinator resolves it."""
    import math

    from broker_coordinator.settings.round_settings import RoundSettings
    from edgefl_protocol import codec
    from edgefl_models.architectures import build_model
    configured = configured or RoundSettings().codec
    return {a: codec.resolve(configured, sum(math.prod(p.shape) for p in build_model(a).state_dict().values()))
            for a in archs}


def measured_with(command: str, settings: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The `measured_with` block of a result: this checkout's commit, the command that ran, the
    deciding settings (key names of `defaults()`), then anything else that decides the numbers."""
    return {"commit": commit(), "command": command, **settings, **extra}


def write_result(name: str, result: dict[str, Any], table: str) -> None:
    """bench/results/NAME.json and NAME.md, and the table on stdout."""
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (results / f"{name}.md").write_text(table)
    print(table)
