"""Configuration is data: TOML files into dataclasses, validated at start-up.

Each section of a TOML file maps onto one dataclass. An environment variable
`<PREFIX>_<SECTION>_<KEY>` (upper case) overrides a file value, which is how
containers and tests adjust a config without editing it.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration problem, naming the file and key at fault."""


def _coerce(value: Any, kind: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        return None if value is None else _coerce(value, options[0], where)
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {value!r}")


def build_section(cls: type[T], values: dict[str, Any], where: str, env_prefix: str | None = None) -> T:
    """Fill dataclass `cls` from a TOML table, environment overrides, then defaults."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known keys: {', '.join(sorted(names))}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        env = f"{env_prefix}_{f.name}".upper() if env_prefix else None
        if env and env in os.environ:
            kwargs[f.name] = _coerce(os.environ[env], hints[f.name], f"environment {env}")
        elif f.name in values:
            kwargs[f.name] = _coerce(values[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key {f.name!r}")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check:
        try:
            check()
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return obj


def read_toml(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable by this user") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """Write flat tables of str/int/float/bool as TOML (None values are left out)."""
    lines: list[str] = []
    for section, table in sections.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (int, float)):
                text = repr(value)
            else:
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)
