"""The coordinator's round keys in sections ([schedule], [algorithm], [fold], [server_optimizer],
[transfer], [evaluation]), and their old place: a 0.1 config with every key under [rounds] loads to
the same RoundSettings, says in one INFO line where each key lives now, and refuses a key given
in both places with different values. (docs/CONFIGURATION.md lists every key in its section:
tests/test_reference_docs.py.)"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from broker_coordinator.settings import config as config_module
from broker_coordinator.settings.config import load_config
from broker_coordinator.settings.round_config import read_rounds
from broker_coordinator.settings.round_sections import PLACES, ROUND_SECTIONS, RoundSections
from broker_coordinator.settings.round_settings import RoundSettings
from edgefl_protocol.settings import ConfigError, to_toml

LOGGER = "broker_coordinator.settings.round_config"
BASE = {"federation": {"model": "digits_mlp", "test_data": "t.npz"}, "broker": {"password": "x"}}

# a value other than the default for every round key, in the section the key belongs to (buffered
# mode refuses evaluation-only rounds, so eval_only_every keeps its default here; SYNC covers it)
EVERY_KEY = {
    "schedule": {"mode": "buffered", "clients_per_round": 5, "selection": "stability", "round_timeout": 60.0,
                 "min_updates": 2, "max_attempts": 0, "buffer_size": 3, "max_staleness": 2,
                 "staleness_weight": "constant"},
    "algorithm": {"algorithm": "fedprox", "hparams": {"mu": 0.01}, "local_epochs": 2, "batch_size": 16, "lr": 0.1,
                  "lr_decay": 0.99, "momentum": 0.5, "weight_decay": 0.0, "grad_clip": 5.0},
    "fold": {"aggregator": "centered_clip", "weighting": "uniform", "weight_cap": 3.0, "norm_bound": 2.0,
             "max_update_norm": 100.0, "normalize_steps": True, "trim": 0.1, "reference": "median",
             "sign_quorum": 0.1, "kinship": 0.4, "agreement_floor": 0.05, "agreement_flags": 2, "verdict_banks": 8,
             "root_trust": True},
    "server_optimizer": {"server_optimizer": "adam", "server_lr": 0.02, "server_lr_decay": 0.99,
                         "server_momentum": 0.8, "beta1": 0.8, "beta2": 0.9, "tau": 0.01},
    "transfer": {"codec": "float32", "model_codec": "float32", "model_chunk_bytes": 65536, "downlink": "delta",
                 "downlink_codec": "q8", "downlink_chain": 4},
    "evaluation": {"evaluate": "central", "eval_only_every": 0, "serve_average": 0.5},
}
SYNC = {"schedule": {"min_updates": 3}, "fold": {"aggregator": "mean"}, "evaluation": {"eval_only_every": 5}}


def write(tmp_path: Path, sections: dict, name: str = "coordinator.toml") -> Path:
    path = tmp_path / name
    tables = {**BASE, **sections}
    lines = []
    for section, table in tables.items():  # to_toml writes flat tables; hparams is an inline table
        inline = {k: v for k, v in table.items() if isinstance(v, dict)}
        lines.append(to_toml({section: {k: v for k, v in table.items() if k not in inline}}))
        lines += [f"{k} = {{ {', '.join(f'{n} = {x!r}' for n, x in v.items())} }}\n" for k, v in inline.items()]
    path.write_text("".join(lines))
    return path


def old_style(sections: dict) -> dict:
    """The same keys as a 0.1 config gives them: all in [rounds]."""
    return {"rounds": {key: value for table in sections.values() for key, value in table.items()}}


def test_every_round_key_has_one_section_and_the_engines_default():
    fields = {f.name: f for f in dataclasses.fields(RoundSettings)}
    assert set(PLACES) == set(fields) - {"privacy"}
    assert {key for table in EVERY_KEY.values() for key in table} == set(PLACES)
    assert all(PLACES[key] == section for section, table in EVERY_KEY.items() for key in table)
    defaults, sections = RoundSettings(), RoundSections()
    for key, section in PLACES.items():
        assert getattr(getattr(sections, section), key) == getattr(defaults, key), key
    assert RoundSettings.from_sections(defaults.sections()) == defaults
    assert set(ROUND_SECTIONS) | {"privacy", "rounds"} <= set(config_module.SECTIONS)


@pytest.mark.parametrize("sections", [EVERY_KEY, SYNC], ids=["buffered", "sync"])
def test_an_old_config_loads_to_the_same_settings_as_a_sectioned_one(tmp_path, sections):
    new = load_config(write(tmp_path, sections, "new.toml")).rounds
    old = load_config(write(tmp_path, old_style(sections), "old.toml")).rounds
    assert old == new
    for table in sections.values():
        assert all(getattr(new, key) == value for key, value in table.items())
    changed = {key for key in PLACES if getattr(new, key) != getattr(RoundSettings(), key)}
    assert changed == {key for table in sections.values() for key, value in table.items()
                       if value != getattr(RoundSettings(), key)}


def test_the_old_places_are_named_in_one_info_line(tmp_path, caplog):
    path = write(tmp_path, {"rounds": {"norm_bound": 2.0, "lr": 0.1}, "schedule": {"min_updates": 2}})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        settings = load_config(path).rounds
    assert (settings.norm_bound, settings.lr, settings.min_updates) == (2.0, 0.1, 2)
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage() == (f"config {path}: [rounds] norm_bound is now [fold] norm_bound; [rounds] lr is "
                                     "now [algorithm] lr (the old places keep working)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_config(write(tmp_path, EVERY_KEY, "new.toml"))
    assert not [r for r in caplog.records if r.name == LOGGER]  # a sectioned config: nothing to say


def test_a_key_in_both_places_must_agree(tmp_path):
    both = {"rounds": {"norm_bound": 1.5, "lr": 0.1}, "fold": {"norm_bound": 2.0}, "algorithm": {"lr": 0.1}}
    with pytest.raises(ConfigError, match=re.escape("[rounds] norm_bound = 1.5 and [fold] norm_bound = 2.0 disagree; "
                                                    "give norm_bound once, in [fold]")):
        load_config(write(tmp_path, both))
    both["fold"]["norm_bound"] = 1.5  # the same value twice is only said once more than needed
    assert load_config(write(tmp_path, both)).rounds.norm_bound == 1.5
    with pytest.raises(ConfigError, match=r'\[rounds\] aggregator = "mean" and \[fold\] aggregator = "median"'):
        load_config(write(tmp_path, {"rounds": {"aggregator": "mean"}, "fold": {"aggregator": "median"}}))


@pytest.mark.parametrize("section,key,value,says", [
    ("schedule", "round_timeout", -1, "round_timeout must be > 0, got -1.0"),
    ("schedule", "selection", "fastest", "selection must be one of random, stability, got 'fastest'"),
    ("algorithm", "lr_decay", 1.5, "lr_decay must be in (0, 1], got 1.5"),
    ("algorithm", "local_epochs", 150, "local_epochs must be a whole number 0-100"),
    ("fold", "norm_bound", -1, "norm_bound must be 0 (off) or >= 1 (times the median norm of recent updates), got -1.0"),
    ("fold", "aggregator", "krum", "aggregator must be one of centered_clip, mean"),
    ("server_optimizer", "tau", 0, "tau must be > 0"),
    ("transfer", "model_chunk_bytes", 10, "model_chunk_bytes must be >= 1024, got 10"),
    ("transfer", "downlink_chain", 0, "downlink_chain must be in [1,"),
    ("evaluation", "serve_average", 1.5, "serve_average must be in [0, 1)"),
])
def test_a_bad_value_names_its_section_and_key(tmp_path, section, key, value, says):
    new = write(tmp_path, {section: {key: value}}, "new.toml")
    with pytest.raises(ConfigError, match=re.escape(f"{new} [{section}]: {says}")):
        load_config(new)
    old = write(tmp_path, {"rounds": {key: value}}, "old.toml")
    with pytest.raises(ConfigError, match=re.escape(f"{old} [{section}]: {says}") + r".*\(given as \[rounds\] " + key):
        load_config(old)


def test_unknown_and_misplaced_keys_fail_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"\[rounds\]: unknown key\(s\) norm_boud; known keys: aggregator"):
        load_config(write(tmp_path, {"rounds": {"norm_boud": 2.0}}))
    with pytest.raises(ConfigError, match=r"\[fold\]: unknown key\(s\) norm_boud; known keys: aggregator, agreement"):
        load_config(write(tmp_path, {"fold": {"norm_boud": 2.0}}))
    with pytest.raises(ConfigError, match=r"\[fold\]: lr is not a \[fold\] key; it belongs in \[algorithm\]"):
        load_config(write(tmp_path, {"fold": {"lr": 0.1}}))
    with pytest.raises(ConfigError, match=r"unknown section\(s\) folds"):
        load_config(write(tmp_path, {"folds": {"norm_bound": 2.0}}))


def test_the_environment_moves_with_its_keys(tmp_path, monkeypatch, caplog):
    path = write(tmp_path, {"algorithm": {"lr": 0.2}})
    monkeypatch.setenv("EDGEFL_COORDINATOR_ALGORITHM_LR", "0.3")
    assert load_config(path).rounds.lr == 0.3
    monkeypatch.setenv("EDGEFL_COORDINATOR_ROUNDS_LR", "0.4")
    with pytest.raises(ConfigError, match="EDGEFL_COORDINATOR_ROUNDS_LR=0.4 and EDGEFL_COORDINATOR_ALGORITHM_LR=0.3 "
                                          "disagree"):
        load_config(path)
    monkeypatch.delenv("EDGEFL_COORDINATOR_ALGORITHM_LR")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert load_config(path).rounds.lr == 0.4  # the old variable still overrides the file
    assert "environment EDGEFL_COORDINATOR_ROUNDS_LR is now EDGEFL_COORDINATOR_ALGORITHM_LR" in caplog.text


def test_overrides_go_over_either_place_and_composition_spans_sections():
    raw = {"rounds": {"lr": 0.1}, "fold": {"norm_bound": 2.0}}
    settings = read_rounds(raw, "c.toml", overrides={"lr": 0.3, "norm_bound": 0})
    assert (settings.lr, settings.norm_bound) == (0.3, 0)
    with pytest.raises(ConfigError, match=r"mode buffered \+ eval_only_every is refused"):
        read_rounds({"schedule": {"mode": "buffered"}, "evaluation": {"eval_only_every": 2}}, "c.toml")
    with pytest.raises(ConfigError, match=r"\[rounds\]: privacy is a section of its own"):
        read_rounds({"rounds": {"privacy": {"mode": "central"}}}, "c.toml")

