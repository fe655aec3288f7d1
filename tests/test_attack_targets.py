"""bench/attacks_report.targets: issue 20's targets judged on any fold's own cells."""

from bench.attacks_report import HEADLINE, SECOND, targets


def _cell(*finals: float, success: float | None = None) -> dict:
    cell = {"final_accuracy": list(finals), "honest_left_out": 0.0}
    if success is not None:
        cell["attack_success"] = [success] * len(finals)
    return cell


def test_each_fold_is_judged_on_its_own_cells_and_against_the_mean_serving_the_same_model():
    head = {"absent@0.2": {"a": _cell(0.90, 0.90), "b": _cell(0.90, 0.90)},
            "sign_flip@0.2": {"a": _cell(0.89, 0.88), "b": _cell(0.86, 0.89)},  # b: 4 points below in seed 1
            "backdoor@0.2": {"a": _cell(0.90, 0.90, success=0.1), "b": _cell(0.90, 0.90, success=0.5)},
            "clean": {"a": _cell(0.91, 0.91), "b": _cell(0.90, 0.90), "mean": _cell(0.91, 0.91),
                      "mean+serve0": _cell(0.88, 0.88)}}
    runs = {HEADLINE: head, SECOND: {}}
    a, b = targets(runs, "a"), targets(runs, "b")
    assert a["sign_flip@0.2 within 3 of absent"] == {"worst_points_below": 2.0, "met": True}
    assert b["sign_flip@0.2 within 3 of absent"]["met"] is False
    assert a["backdoor@0.2 success <= 0.2"]["met"] and not b["backdoor@0.2 success <= 0.2"]["met"]
    assert a[f"{HEADLINE} clean within 0.5 of mean"]["met"]
    assert b[f"{HEADLINE} clean within 0.5 of mean"] == {"points_below": 1.0, "met": False}
    # a fold that serves the last model is held to the plain mean serving the last model
    last = {**head, "clean": {**head["clean"], "centered_clip+serve0": _cell(0.88, 0.88)}}
    judged = targets({HEADLINE: last, SECOND: {}}, "centered_clip+serve0")
    assert judged[f"{HEADLINE} clean within 0.5 of mean"] == {"points_below": 0.0, "met": True}
