"""The rule that chooses the default across settings (bench/field_settings_report.choose)."""

import pytest

from bench.field_settings_report import choose, summarize, targets
from broker_coordinator.settings.round_settings import RoundSettings


def _row(finals: list[float], passes: float) -> dict:
    return {"seeds": list(range(1, len(finals) + 1)), "final_accuracy": finals, "passes": passes,
            "passes_vs_fedavg": None}


def _table(rows: dict[str, dict[str, tuple[list[float], float]]]) -> dict:
    table = {}
    for setting, values in rows.items():
        table[setting] = {row: _row(*v) for row, v in values.items()}
        for row, v in table[setting].items():
            v["passes_vs_fedavg"] = v["passes"] / table[setting][f"fedavg+{row.split('+')[1]}"]["passes"]
    return table


def test_the_best_worst_case_wins_not_the_best_mean():
    table = _table({
        "a": {"fedavg+sgd": ([90, 90], 10), "x+sgd": ([96, 96], 10), "y+sgd": ([92, 92], 10)},
        "b": {"fedavg+sgd": ([80, 80], 10), "x+sgd": ([79, 79], 10), "y+sgd": ([81, 81], 10)},
    })
    choice = choose(table, ["a", "b"], seeds=2)
    assert choice["row"] == "y+sgd"  # x is +6 and -1, y +2 and +1
    assert choice["worst_case_vs_fedavg"] == 1.0
    assert choice["margins"]["x+sgd"] == {"a": 6.0, "b": -1.0}


def test_rows_over_the_passes_budget_or_short_of_seeds_are_not_candidates():
    table = _table({
        "a": {"fedavg+sgd": ([90, 90], 10), "costly+sgd": ([99, 99], 14), "short+sgd": ([99], 10),
              "fine+sgd": ([91, 91], 13)},
    })
    choice = choose(table, ["a"], seeds=2)
    assert set(choice["margins"]) == {"fedavg+sgd", "fine+sgd"}
    assert choice["row"] == "fine+sgd"


def test_a_momentum_row_is_measured_against_fedavg_with_momentum():
    table = _table({"a": {"fedavg+sgd": ([90, 90], 10), "fedavg+momentum": ([95, 95], 10),
                          "x+momentum": ([94, 94], 10)}})
    assert choose(table, ["a"], seeds=2)["margins"]["x+momentum"] == {"a": -1.0}


def test_no_candidate_says_why():
    assert choose({"a": {}}, ["a"], seeds=3) == {"row": None, "margins": {},
                                                  "why": "no row has every seed on every setting yet"}


def test_summarize_keys_rows_by_client_and_server_optimizer_and_scores_the_served_model():
    record = {"setting": "s", "variant": "dynsam", "momentum": 0.0, "seed": 1, "accuracy": [0.5, 0.9, 0.88],
              "ema_accuracy": {"0.75": [0.4, 0.8, 0.85]},
              "signals": [{"d": {"passes": 4}}], "deciding": {"server_optimizer": "adam"}, "commit": "abc"}
    plain = {**record, "variant": "fedavg", "deciding": {}, "signals": [{"d": {"passes": 2}}]}
    table = summarize([record, plain])["s"]
    assert RoundSettings().serve_average == 0.75  # the served average is what the rows score
    assert table["dynsam+sgd+adam"]["final_accuracy"] == [85.0]
    assert table["dynsam+sgd+adam"]["final_minus_best_worst"] == 0.0
    assert table["dynsam+sgd+adam"]["last_model_final"] == [88.0]
    assert table["dynsam+sgd+adam"]["last_model_final_minus_best_worst"] == -2.0
    assert table["dynsam+sgd+adam"]["passes_vs_fedavg"] == 2.0
    assert table["fedavg+sgd"]["passes_vs_fedavg"] == 1.0


def test_a_run_without_the_served_average_is_refused_with_what_to_do():
    record = {"setting": "s", "variant": "fedavg", "momentum": 0.0, "seed": 1, "accuracy": [0.5, 0.9],
              "signals": [{"d": {"passes": 2}}], "deciding": {}, "commit": "abc"}
    with pytest.raises(ValueError, match=r"no served average at decay 0.75: rerun it"):
        summarize([record])


def _stable(table: dict) -> dict:
    for rows in table.values():
        for v in rows.values():
            v["final_minus_best_worst"] = 0.0
    return table


def test_the_headline_target_counts_fedavg_rows_and_names_the_best_other_algorithm():
    table = _stable(_table({"h": {"fedavg+sgd": ([90, 90], 10), "fedavg+sgd+adagrad": ([93, 93], 10),
                                  "x+sgd": ([93.3, 93.3], 10), "x-leaky+sgd": ([93.2, 93.2], 10)}}))
    lines = targets(table, "x+sgd", "h")
    assert "- h: x+sgd vs fedavg+sgd: +3.30 points (target >= +2.0): **met**" in lines
    assert "- h: vs the best other row x-leaky+sgd: +0.10 points (target >= +0.5): **missed**" in lines
    # a variant of the default's own algorithm is not another algorithm; FedAvg with adagrad is
    assert "- h: vs the best other algorithm fedavg+sgd+adagrad: +0.30 points (target >= +0.5): **missed**" in lines
