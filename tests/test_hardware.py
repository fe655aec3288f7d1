from edge_agent.hardware import MAX_EPOCHS, MIN_EPOCHS, calibrate, plan_epochs, probe
from models.architectures import ARCHITECTURES, build_model


def test_probe_reports_the_basics():
    profile = probe()
    assert profile["cores"] >= 1 and profile["memory_mb"] > 0


def test_calibration_measures_a_positive_speed():
    arch = ARCHITECTURES["digits_mlp"]
    assert calibrate(build_model("digits_mlp"), arch.input_shape, arch.num_classes, seconds=0.1) > 0


def test_epochs_follow_speed_between_three_and_eight():
    weak = plan_epochs(100, 500, seconds_left=1e6)
    strong = plan_epochs(10_000, 500, seconds_left=1e6)
    middle = plan_epochs(1000, 500, seconds_left=1e6)
    assert (weak.epochs, strong.epochs) == (MIN_EPOCHS, MAX_EPOCHS)
    assert MIN_EPOCHS < middle.epochs < MAX_EPOCHS


def test_high_tau_halves_epochs():
    plan = plan_epochs(10_000, 500, seconds_left=1e6, tau=0.3)
    assert plan.epochs == MAX_EPOCHS // 2 and "halved" in plan.reason


def test_deadline_caps_epochs_but_never_below_one():
    # 1000 samples at 1000 samples/s with 2 passes per step = 2 s per epoch; 10 s left * 0.7 margin -> 3 epochs
    plan = plan_epochs(1000, 1000, seconds_left=10, passes_per_step=2)
    assert plan.epochs == 3 and "deadline" in plan.reason
    assert plan_epochs(10, 10_000, seconds_left=1).epochs == 1
