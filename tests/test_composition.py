"""The one composition check: every refusal is a rule of `composition`, worded once, raised at
config load for every entry point, and listed in docs/ARCHITECTURE.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker_coordinator.settings import composition
from broker_coordinator.settings.config import load_config
from broker_coordinator.settings.privacy_settings import PrivacySettings
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_protocol.settings import ConfigError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"


def test_the_defaults_compose_in_every_schedule_and_topology():
    for mode in ("sync", "buffered"):
        for topology in composition.TOPOLOGIES:
            settings = RoundSettings(mode=mode, algorithm="fedavg" if mode == "buffered" else "dynsam")
            assert composition.refusals(settings, topology) == [], (mode, topology)


@pytest.mark.parametrize("aggregator", ["gated_mean", "trimmed_mean", "median", "geomed"])
def test_sites_refuse_folds_that_need_every_delta_and_say_which_run(aggregator):
    with pytest.raises(ValueError, match=r"set aggregator = one of centered_clip, mean"):
        composition.check(RoundSettings(aggregator=aggregator), "sites")
    composition.check(RoundSettings(aggregator=aggregator), "flat")


def test_config_load_refuses_a_site_combination_before_anything_starts(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[federation]\ntest_data = "t.npz"\nmodel = "digits_mlp"\n[broker]\npassword = "x"\n'
                    '[rounds]\nmode = "buffered"\nalgorithm = "fedavg"\naggregator = "median"\n'
                    '[sites.north]\ndevices = "north-*"\n')
    with pytest.raises(ConfigError, match=r"aggregator gated_mean \| trimmed_mean \| median \| geomed is refused \(mathematical"):
        load_config(path)


def test_every_rule_is_listed_in_the_architecture_doc():
    text = DOCS.read_text()
    section = text[text.index("## What runs together"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(composition.RULES)
    for row, rule in zip(rows, composition.RULES):
        kind = row.split("|")[-3].strip() if row.count("|") >= 4 else ""
        assert rule.kind in row, f"{rule.combination}: the doc's row says {kind!r}"
        for word in re.findall(r"[a-z_]+", rule.combination):
            if len(word) > 3 and word not in ("with", "topology", "mode", "algorithm", "aggregator", "duals"):
                assert word in row, f"{rule.combination}: {word!r} is not in the doc's row {row!r}"


@pytest.mark.parametrize("setting,value,off", [("kinship", 0.4, 0), ("verdict_banks", 8, 0),
                                               ("agreement_floor", 0.05, 0), ("agreement_flags", 2, 1)])
def test_centered_clip_s_opt_in_stages_run_everywhere_it_runs_and_never_under_central_privacy(setting, value, off):
    """kinship, agreement_floor and agreement_flags (aggregation/consensus.py) and verdict_banks
    (aggregation/banks.py) act on what centered_clip's consensus flags: every schedule and topology, no
    other fold, no central privacy."""
    for topology in composition.TOPOLOGIES:
        for mode in ("sync", "buffered"):
            assert composition.refusals(RoundSettings(**{setting: value}, mode=mode, algorithm="fedavg"), topology) == []
    with pytest.raises(ValueError, match=rf'{setting} \+ aggregator .* is refused \(not built.*set {setting} = {off}, '
                                         r'or aggregator = "centered_clip"'):
        composition.check(RoundSettings(**{setting: value}, aggregator="mean"))
    private = RoundSettings(**{setting: value}, algorithm="fedavg",
                            privacy=PrivacySettings(mode="central", noise_multiplier=1.0))
    with pytest.raises(ValueError, match=rf"privacy central \+ {setting} is refused \(mathematical"):
        composition.check(private)
