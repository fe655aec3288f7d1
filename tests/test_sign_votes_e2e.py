"""The sign-vote stage through real brokers: buffered versions folded in bridged sites, the
default algorithm and fold with `sign_quorum` on, real agent processes (`simulate`). The model
must learn, and every version's record says what share of the parameters the votes held still."""

from __future__ import annotations

import dataclasses

from bench.composition import Cell, run_cell


def test_sign_votes_run_in_buffered_sites_and_the_model_learns(tmp_path, monkeypatch):
    cell = Cell("buffered", "sites", "dynsam", "default", "full", "central")
    plain = Cell.settings

    def with_votes(self, round_timeout: float = 20.0):
        return dataclasses.replace(plain(self, round_timeout), sign_quorum=0.3)

    monkeypatch.setattr(Cell, "settings", with_votes)
    history: list[dict] = []
    import broker_coordinator.simulation.simulate as simulate_module
    real = simulate_module.simulate

    def recorded(spec, settings, **kwargs):
        assert settings.sign_quorum == 0.3
        history.extend(real(spec, settings, **kwargs))
        return history

    monkeypatch.setattr(simulate_module, "simulate", recorded)
    row = run_cell(cell, tmp_path, agents=4, versions=3)
    assert row["ok"], f"{row['first_score']} -> {row['final_score']} ({row['detail']})"
    held = [r["unvoted"] for r in history]
    assert held and all(v is not None and 0 <= v < 1 for v in held), held
