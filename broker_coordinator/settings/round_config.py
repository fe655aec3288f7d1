"""Reading the round sections of a coordinator config, and the round keys' old place.

Release 0.1 read every round key from one `[rounds]` table; each key now has a section that says
what it is about (`round_sections`: [schedule], [algorithm], [fold], [server_optimizer],
[transfer], [evaluation]), under the same name. A config written for 0.1 keeps working: each
`[rounds]` key is read into its section, and one INFO line at start-up says where every key given
in its old place lives now. The environment moves the same way (EDGEFL_COORDINATOR_ROUNDS_LR is
read as EDGEFL_COORDINATOR_ALGORITHM_LR). A key given in both places with different values is an
error naming both; a key in neither place's list fails as it always has, naming the known keys.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_sections import PLACES, ROUND_SECTIONS, RoundSections
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_protocol.settings import ConfigError, build_section

OLD_SECTION = "rounds"
log = logging.getLogger(__name__)


@dataclass
class Gathered:
    """A config's round keys, sorted into their sections."""

    tables: dict[str, dict[str, Any]]  # section -> its keys, those given in their old place read into it
    moved: list[str]  # "[rounds] norm_bound is now [fold] norm_bound", one entry per key given in its old place
    origins: dict[tuple[str, str], str]  # (section, key) -> its old place, for the keys given there


def _shown(value: Any) -> str:
    """A value as TOML writes it (strings quoted, true/false), for an error message."""
    return json.dumps(value) if isinstance(value, (str, bool)) else repr(value)


def gather(raw: dict[str, Any], where: str, env_prefix: str | None = None) -> Gathered:
    """Sort the round sections' tables and the old `[rounds]` keys (and, with `env_prefix`, the
    old environment variables) into sections. ConfigError: a misplaced, unknown or conflicting key."""
    tables: dict[str, dict[str, Any]] = {}
    for name in (*ROUND_SECTIONS, OLD_SECTION):
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {name} must be a table ([{name}])")
        tables[name] = dict(table)
        for key in table:
            if name != OLD_SECTION and PLACES.get(key, name) != name:
                raise ConfigError(f"{where} [{name}]: {key} is not a [{name}] key; it belongs in [{PLACES[key]}]")
    old = tables.pop(OLD_SECTION)
    if "privacy" in old:
        raise ConfigError(f"{where} [rounds]: privacy is a section of its own: give its keys under [privacy]")
    unknown = sorted(set(old) - set(PLACES))
    if unknown:
        raise ConfigError(f"{where} [rounds]: unknown key(s) {', '.join(unknown)}; known keys: "
                          f"{', '.join(sorted(PLACES))}")
    moved: list[str] = []
    origins: dict[tuple[str, str], str] = {}
    for key, value in old.items():
        section = PLACES[key]
        given = tables[section]
        if key in given and given[key] != value:
            raise ConfigError(f"{where}: [rounds] {key} = {_shown(value)} and [{section}] {key} = "
                              f"{_shown(given[key])} disagree; give {key} once, in [{section}]")
        given[key] = value
        moved.append(f"[rounds] {key} is now [{section}] {key}")
        origins[(section, key)] = f"[rounds] {key}"
    for key, section in PLACES.items() if env_prefix else ():
        old_env, new_env = (f"{env_prefix}_{place}_{key}".upper() for place in (OLD_SECTION, section))
        if old_env not in os.environ:
            continue
        value = os.environ[old_env]
        if new_env in os.environ and os.environ[new_env] != value:
            raise ConfigError(f"environment {old_env}={value} and {new_env}={os.environ[new_env]} disagree; "
                              f"set {new_env} only")
        tables[section][key] = value  # over the file's value, as the environment always was
        moved.append(f"environment {old_env} is now {new_env}")
        origins[(section, key)] = f"environment {old_env}"
    return Gathered(tables, moved, origins)


def notice(where: str, moved: list[str]) -> str:
    """The one start-up line naming each key given in its old place and its new place."""
    return f"config {where}: {'; '.join(moved)} (the old places keep working)"


def _section(name: str, gathered: Gathered, where: str, env_prefix: str | None) -> Any:
    """One round section, built and validated; an error about a key given in its old place says so."""
    try:
        return build_section(ROUND_SECTIONS[name], gathered.tables[name], f"{where} [{name}]",
                             f"{env_prefix}_{name}" if env_prefix else None)
    except ConfigError as exc:
        text = str(exc)
        key = getattr(exc.__context__, "key", None)  # the section's SettingError, when a value is out of range
        for (section, moved), origin in gathered.origins.items():
            if section == name and (moved == key or f"[{name}].{moved}:" in text):
                text += f" (given as {origin})"
        raise ConfigError(text) from None


def read_rounds(raw: dict[str, Any], where: str, env_prefix: str | None = None,
                overrides: dict[str, Any] | None = None) -> RoundSettings:
    """The RoundSettings a config's round sections, its [rounds] keys and [privacy] describe, with
    `overrides` (key -> value, e.g. simulate's flags) over all of them; validated, what spans
    sections too. Logs the keys given in their old place in one INFO line."""
    gathered = gather(raw, where, env_prefix)
    for key, value in (overrides or {}).items():
        gathered.tables[PLACES[key]][key] = value
        gathered.origins.pop((PLACES[key], key), None)
    # [privacy] first: what it rules out in the other sections is refused naming both (composition)
    privacy = build_section(PrivacySettings, raw.get("privacy", {}), f"{where} [privacy]",
                            f"{env_prefix}_privacy" if env_prefix else None)
    sections = RoundSections(**{name: _section(name, gathered, where, env_prefix) for name in ROUND_SECTIONS},
                             privacy=privacy)
    settings = RoundSettings.from_sections(sections)
    try:
        settings.check_together()
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if gathered.moved:
        log.info(notice(where, gathered.moved))
    return settings
