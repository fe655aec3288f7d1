"""`edge-agent install-service --serve`: the serving store where applications can read it, and the
prediction server's unit (systemd/edge-agent-serve.service) beside the agent's.

Under its unit the agent is a DynamicUser and its state directory is private (systemd keeps it under
/var/lib/private, 0700), so the store must live elsewhere with an owner that does not change between
starts. systemd runs a DynamicUser= service as the static user of the same name when one exists, so
the plan creates the system user `edge-agent` (and the store's group, `[serving] group`), makes the
store's directory owned by that user and group (2750: the agent writes, the group reads, new entries
keep the group), and lets the agent's unit write there (ReadWritePaths=, SupplementaryGroups=).
`edge-agent serve` runs as a user of its own in the group, with the store read-only.
"""

from __future__ import annotations

import grp
import pwd
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

AGENT_USER = "edge-agent"  # the agent unit's name: DynamicUser= picks the static user by that name
SERVE_UNIT_NAME = "edge-agent-serve.service"
SERVE_SOCKET = "/run/edgefl-serve/serve.sock"
EXAMPLE_DIR = "/var/lib/edgefl-serving"


class ServingSetupError(ValueError):
    """The agent's [serving] section cannot give applications a store; the message says what to set."""


@dataclass(frozen=True)
class ServingSetup:
    store: Path
    group: str

    @classmethod
    def from_config(cls, config_path: Path) -> ServingSetup:
        from edgefl_protocol.settings import ConfigError

        from .config import load_config
        try:
            config = load_config(config_path)
        except ConfigError as exc:
            raise ServingSetupError(f"--serve reads [serving] from the agent config: {exc}") from None
        serving, state = config.serving, Path(config.device.state_dir).absolute()
        fix = f'set [serving] dir = "{EXAMPLE_DIR}" and group = "edgefl-model" in {config_path}'
        if not serving.dir:
            raise ServingSetupError(f'[serving] dir is "" (no serving store): {fix}')
        store = Path(serving.dir).absolute()
        if store == state or state in store.parents:
            raise ServingSetupError(f"[serving] dir {store} is inside the agent's state directory, which only the "
                                    f"agent may enter: {fix}")
        if not serving.group:
            raise ServingSetupError(f"[serving] group is not set, so no application could read the store: {fix}")
        return cls(store, serving.group)

    def commands(self) -> list[list[str]]:
        """What makes the user, the group and the store's directory (only what is missing)."""
        out = []
        if not _exists(grp.getgrnam, self.group):
            out.append(["groupadd", "--system", self.group])
        if not _exists(pwd.getpwnam, AGENT_USER):
            out.append(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
                        "/usr/sbin/nologin", AGENT_USER])
        out.append(["install", "-d", "-o", AGENT_USER, "-g", self.group, "-m", "2750", str(self.store)])
        return out

    def agent_unit(self, text: str) -> str:
        """The agent's unit, allowed to write the store and in its group."""
        lines = f"ReadWritePaths={self.store}\nSupplementaryGroups={self.group}\n"
        return re.sub(r"^(StateDirectoryMode=.*\n)", lambda m: m.group(1) + lines, text, count=1, flags=re.M)

    def serve_unit(self, template: str, agent_command: str) -> str:
        exec_start = shlex.join(["serve", "--dir", str(self.store), "--socket", SERVE_SOCKET, "--group", self.group,
                                 "--threads", "1"])
        text = re.sub(r"^ExecStart=.*$", f"ExecStart={agent_command} {exec_start}", template, count=1, flags=re.M)
        text = re.sub(r"^ReadOnlyPaths=.*$", f"ReadOnlyPaths=-{self.store}", text, count=1, flags=re.M)
        return re.sub(r"^SupplementaryGroups=.*$", f"SupplementaryGroups={self.group}", text, count=1, flags=re.M)


def _exists(lookup, name: str) -> bool:  # noqa: ANN001 - grp.getgrnam or pwd.getpwnam
    try:
        lookup(name)
        return True
    except KeyError:
        return False
