"""An algorithm with extra tensors both ways (FedSMOO: mu up, s down) through a
real Mosquitto and agent processes, with every device's report recorded."""

import json
import subprocess
import sys


def test_fedsmoo_over_mqtt_carries_its_duals_and_records_device_reports(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--agents", "2", "--rounds", "2",
                             "--dataset", "digits", "--algorithm", "fedsmoo", "--hparam", "sam_every=4",
                             "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    rounds = json.loads((out / "history.json").read_text())["rounds"]
    assert [r["participants"] for r in rounds] == [2, 2] and all(sum(r["rejected"].values()) == 0 for r in rounds)
    # round 2 closed, so the server rule found every device's mu (FedSMOO's new_global needs it) and the
    # agents decoded the released s beside the weights
    for device, report in rounds[-1]["devices"].items():
        assert {"passes", "steps", "train_loss", "train_seconds", "num_samples"} <= set(report), device


def test_unknown_hparam_is_one_line():
    result = subprocess.run([sys.executable, "-m", "broker_coordinator", "simulate", "--algorithm", "fedprox",
                             "--hparam", "rho=0.1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "fedprox has no hyper-parameter rho" in result.stderr
    assert "Traceback" not in result.stderr
