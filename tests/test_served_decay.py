"""research/served_decay.py: the cross-settings rows re-scored at each serve_average from the same runs."""

from bench.field_settings import SETTINGS
from research import served_decay


def _run(setting: str, variant: str, seed: int, last: list[float], smooth: list[float]) -> dict:
    return {"setting": setting, "variant": variant, "momentum": 0.0, "deciding": {}, "seed": seed,
            "commit": "test", "accuracy": last,
            "ema_accuracy": {"0.5": last, "0.75": last, "0.9": smooth},
            "signals": [{"dev-1": {"passes": 10}} for _ in last]}


def test_a_late_decline_of_the_last_model_is_counted_per_decay():
    records = []
    for setting in SETTINGS:
        for seed in (1, 2, 3):
            # dynsam's last model peaks and falls 3 points; its slow average does not fall
            records.append(_run(setting, "dynsam", seed, [0.90, 0.95, 0.92], [0.85, 0.90, 0.93]))
            records.append(_run(setting, "fedavg", seed, [0.80, 0.85, 0.85], [0.75, 0.80, 0.84]))
    last = served_decay.at_decay(records, 0.0, "dynsam+sgd")
    slow = served_decay.at_decay(records, 0.9, "dynsam+sgd")
    for setting in SETTINGS:
        assert last["settings"][setting]["unstable_rows"] == ["dynsam+sgd"]
        assert last["settings"][setting]["default_final_minus_best_worst"] == -3.0
        assert last["settings"][setting]["default_vs_fedavg"] == 7.0
        assert slow["settings"][setting]["unstable_rows"] == []
        assert slow["settings"][setting]["default_final"] == 93.0
    assert last["choice"] == slow["choice"] == "dynsam+sgd"
    assert slow["worst_case_vs_fedavg"] == 9.0
