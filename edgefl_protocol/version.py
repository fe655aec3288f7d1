"""Which release of EdgeFL this is, and which protocol versions it speaks: what a device says of
its software in its presence, so that the operator sees the fleet's versions (`status`, `devices
list`, Prometheus' `edgefl_agents{version}`)."""

from __future__ import annotations

import platform
from importlib import metadata

from .protocol import SPOKEN as PROTOCOLS  # the protocol versions this release speaks
UNKNOWN = "unknown"  # what the coordinator calls an agent that does not say (0.1.0 and earlier)


def release() -> str:
    """The installed package's version (pyproject.toml is its one source)."""
    try:
        return metadata.version("edgefl")
    except metadata.PackageNotFoundError:
        return "0+unknown"  # a checkout that was never installed


def software() -> dict[str, str]:
    """What a device reports of its software in its presence (flat scalars, as a status profile holds)."""
    return {"agent": release(), "protocols": ",".join(str(p) for p in PROTOCOLS),
            "python": platform.python_version(), "machine": platform.machine()}
