"""bench/engine_parity.py's comparison logic (no training, no processes)."""

from __future__ import annotations

import math

from bench.engine_parity import compare_runs, compare_series, interleaved, throughput_summary


def test_identical_series_have_no_differing_round():
    s = compare_series([0.1, 0.5, 0.9], [0.1, 0.5, 0.9])
    assert s == {"rounds_cached": 3, "rounds_fresh": 3, "rounds_compared": 3, "rounds_identical": 3,
                 "max_abs_diff": 0.0, "first_differing_round": None}


def test_the_first_differing_round_is_one_based_and_the_gap_is_the_largest():
    s = compare_series([0.1, 0.5, 0.9, 0.9], [0.1, 0.6, 0.9, 0.7])
    assert (s["rounds_identical"], s["first_differing_round"]) == (2, 2)
    assert math.isclose(s["max_abs_diff"], 0.2)


def test_a_missing_round_differs_and_nan_equals_nan():
    s = compare_series([0.1, float("nan"), 0.3], [0.1, float("nan")])
    assert (s["rounds_compared"], s["rounds_identical"], s["first_differing_round"]) == (2, 2, 3)


def test_a_run_is_identical_only_when_every_series_the_cache_holds_is():
    cached = {"accuracy": [0.1, 0.2], "served_accuracy": [0.1, 0.3], "clipped": {"norm": 1}}
    assert compare_runs(cached, dict(cached), ("clipped", "absent"))["identical"]
    off = compare_runs(cached, {**cached, "served_accuracy": [0.1, 0.31], "clipped": {"norm": 2}}, ("clipped",))
    assert not off["identical"] and off["also"] == {"clipped": False}
    assert off["series"]["accuracy"]["rounds_identical"] == 2
    assert set(compare_runs({"accuracy": [0.1]}, {"accuracy": [0.1], "served_accuracy": [0.0]})["series"]) == {"accuracy"}


def test_runtime_invocations_alternate_and_the_summary_is_the_median_ratio():
    assert interleaved(2) == [("old", 0), ("new", 0), ("new", 1), ("old", 1)]
    runs = [{"label": label, "scale": [{"size": 100, "updates_per_s": ups, "peak_rss_mb": rss}]}
            for label, ups, rss in (("old", 800, 400), ("new", 1000, 410), ("new", 1200, 410), ("old", 1000, 400))]
    (row,) = throughput_summary(runs)
    assert (row["old_updates_per_s"], row["new_updates_per_s"]) == (900, 1100)
    assert math.isclose(row["updates_per_s_ratio"], 1100 / 900) and row["peak_rss_change_mb"] == 10
