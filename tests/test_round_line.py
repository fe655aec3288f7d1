"""The coordinator's one line per round: a federation that runs until stopped (rounds = 0) prints
no total, so round 120 does not read as the last one. Units."""

from broker_coordinator.reporting.report import format_round

RECORD = {"round": 120, "participants": 3, "selected": 4, "rejected": {}, "closed": "complete", "accuracy": 0.9,
          "score": 0.9, "metric": "accuracy", "loss": 0.3, "bytes_up": 1000, "seconds": 1.0}


def test_a_planned_run_shows_its_total_and_an_open_ended_one_does_not():
    assert format_round(RECORD, 200).startswith("round 120/200  participants")
    assert format_round(RECORD, 0).startswith("round 120  participants")
