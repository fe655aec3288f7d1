"""The sign-vote stage through real brokers: buffered versions folded in bridged sites, the
default algorithm and fold with `sign_quorum` on, real agent processes (`simulate`). The model
must learn, and every version's record says what share of the parameters the votes held still."""

from __future__ import annotations

import dataclasses
import json

from bench.composition import Cell, run_cell


def test_sign_votes_run_in_buffered_sites_and_the_model_learns(tmp_path):
    cell = Cell("buffered", "sites", "dynsam", "default", "full", "central")
    row = run_cell(cell, tmp_path, agents=4, versions=3,
                   settings=dataclasses.replace(cell.settings(), sign_quorum=0.3))
    assert row["ok"], f"{row['first_score']} -> {row['final_score']} ({row['detail']})"
    history = json.loads((tmp_path / "history.json").read_text())
    # `unvoted` is None in a record whose fold ran no votes: a number in every record says they ran
    held = [r["unvoted"] for r in history["rounds"]]
    assert held and all(v is not None and 0 <= v < 1 for v in held), held
