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


def test_state_credential_and_config_files_are_written_atomically_and_fsynced(tmp_path, monkeypatch):
    """One writer for every state, credential and config file (persist.atomic_write): the file is
    replaced whole, fsynced with its directory, with its mode whatever the umask, and a failed write
    leaves the old file and no temp file behind."""
    import os
    import stat

    import pytest

    from broker_coordinator.access.devices import write_file
    from edgefl_protocol import persist, signing

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(persist.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    old_umask = os.umask(0o077)  # a strict umask must not take the group's read bit off the password file
    try:
        signing.write_key_file(tmp_path / "device_keys.toml", {"pi-1": bytes(32)})
        write_file(tmp_path / "passwd", "pi-1:$7$hash\n", 0o640)
        write_file(tmp_path / "edgefl.conf", "listener 1883\n", 0o644)
    finally:
        os.umask(old_umask)
    assert len(synced) == 6  # file and directory, for each of the three (the old writers synced none)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"device_keys.toml": 0o600, "passwd": 0o640, "edgefl.conf": 0o644}  # no temp file left
    assert signing.read_key_file(tmp_path / "device_keys.toml") == {"pi-1": bytes(32)}

    monkeypatch.setattr(persist.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        persist.atomic_write(tmp_path / "passwd", "torn", 0o640)
    assert (tmp_path / "passwd").read_text() == "pi-1:$7$hash\n" and len(list(tmp_path.iterdir())) == 3
