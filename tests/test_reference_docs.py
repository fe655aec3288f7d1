"""The reference pages are the code's: docs/CONFIGURATION.md and docs/CLI.md are what
`python -m tools.gen_reference` writes from the config dataclasses and the argument parsers, and
CONFIGURATION.md lists every key of the coordinator's config in its own section."""

from __future__ import annotations

import dataclasses
import re

import pytest

from broker_coordinator.settings import config as config_module
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_sections import PLACES, ROUND_SECTIONS
from broker_coordinator.settings.site_settings import SiteSettings
from broker_coordinator.settings.tracking_settings import TrackingSettings
from edge_agent import config as agent_config
from tools import gen_reference

FIX = f"run `{gen_reference.COMMAND}` and commit the result"


@pytest.mark.parametrize("path", list(gen_reference.PAGES), ids=lambda p: p.name)
def test_the_committed_reference_is_what_the_code_gives(path):
    committed = path.read_text() if path.exists() else ""
    assert committed == gen_reference.PAGES[path](), f"{path.name} differs from the code: {FIX}"


def _sections(text: str, title: str) -> dict[str, set[str]]:
    """`### [section]` -> the keys of its table, within the `## {title}` part of CONFIGURATION.md."""
    part = text[text.index(f"## {title}"):]
    part = part[:part.find("\n## ", 1)] if "\n## " in part[1:] else part
    found: dict[str, set[str]] = {}
    for block in re.split(r"^### ", part, flags=re.MULTILINE)[1:]:
        name = re.match(r"`\[([\w.]+?)(?:\.NAME)?\]`", block).group(1)
        found[name] = set(re.findall(r"^\| `(\w+)` \|", block, re.MULTILINE))
    return found


def test_every_coordinator_key_is_listed_in_its_section():
    listed = _sections(gen_reference.CONFIGURATION.read_text(), "The coordinator")
    for section in ROUND_SECTIONS:  # the round keys, each in the section it belongs to
        assert listed.get(section) == {key for key, place in PLACES.items() if place == section}, section
    others = {"federation": config_module.FederationSettings, "broker": config_module.CoordinatorBroker,
              "privacy": PrivacySettings, "storage": config_module.StorageSettings,
              "enrollment": config_module.EnrollmentSettings, "metrics": config_module.MetricsSettings,
              "tracking": TrackingSettings, "sites": SiteSettings}
    for section, cls in others.items():
        keys = {f.name for f in dataclasses.fields(cls)} - ({"name"} if section == "sites" else set())
        assert listed.get(section) == keys, section
    assert set(listed) == set(config_module.SECTIONS) - {"rounds"}  # [rounds]: the round keys' old place


def test_every_agent_key_is_listed_in_its_section():
    listed = _sections(gen_reference.CONFIGURATION.read_text(), "The agent")
    for section, cls in (("broker", agent_config.BrokerSettings), ("device", agent_config.DeviceSettings),
                         ("data", agent_config.DataSettings)):
        assert listed.get(section) == {f.name for f in dataclasses.fields(cls)}, section


def test_every_console_script_and_subcommand_is_listed():
    text = gen_reference.CLI.read_text()
    for script in ("broker-coordinator", "edge-agent"):
        assert f"## `{script}`" in text
    for command in ("simulate", "run", "status", "rollback", "site-aggregator", "devices add", "devices list",
                    "devices revoke", "devices rotate", "broker-config", "serve-enrollment"):
        assert f"`broker-coordinator {command}`" in text, command
    for command in ("run", "enroll", "install-service", "status"):
        assert f"`edge-agent {command}`" in text, command
