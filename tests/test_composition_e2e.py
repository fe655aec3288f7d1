"""A pairwise-covering subset of the engine's combinations, run for real: every pair of values of
{schedule, topology, algorithm, fold, downlink, evaluation} that composes is run together at least
once, through `simulate` (real Mosquitto brokers, bridged for sites, and real agent processes), and
must end with a better model than it started from. `make composition` runs every cell."""

from __future__ import annotations

import pytest

from bench.composition import cells, pairwise, refusal, run_cell

SUBSET = pairwise([cell for cell in cells() if not refusal(cell)])


@pytest.mark.parametrize("cell", SUBSET, ids=lambda cell: cell.name())
def test_a_combination_runs_and_learns(tmp_path, cell):
    row = run_cell(cell, tmp_path, agents=4, versions=3)
    assert row["ok"], f"{cell.name()}: {row['first_score']} -> {row['final_score']} ({row['detail']})"


def test_every_cell_of_the_grid_composes():
    """Every schedule, topology, algorithm, fold, downlink and evaluation of the grid runs together
    (the composition rules left refuse only privacy's and the folds that hold the round)."""
    refused = {cell.name(): refusal(cell) for cell in cells() if refusal(cell)}
    assert len(cells()) == 96 and refused == {}
