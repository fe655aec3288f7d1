import numpy as np

from edge_agent.state import DeviceState


def test_state_round_trips_arrays_and_scalars(tmp_path):
    state = DeviceState(tmp_path / "s")
    algo = state.section("drsam")
    algo.update({"g_fin": np.arange(4, dtype=np.float32), "angles": [0.1, 0.2], "lambda": 0.05})
    state.data["last_model_version"] = 7
    state.save()
    again = DeviceState(tmp_path / "s")
    assert again.data["last_model_version"] == 7
    assert np.array_equal(again.section("drsam")["g_fin"], np.arange(4, dtype=np.float32))
    assert again.section("drsam")["angles"] == [0.1, 0.2]


def test_corrupt_state_is_set_aside_not_fatal(tmp_path):
    (tmp_path / "state.msgpack").write_bytes(b"\xc1\xc1garbage")
    state = DeviceState(tmp_path)
    assert state.data == {}
    assert (tmp_path / "state.corrupt").exists()
