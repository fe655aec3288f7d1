"""Device data sources on real files: npz, csv, images, spool; check_fits; the [data] config section."""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.config import DataSettings, load_config
from edge_agent.data_sources import DataError, DataMismatch, check_fits, open_source
from edge_agent.sources import files, spool
from edge_agent.sources.base import held_out_mask
from edgefl_protocol.settings import ConfigError
from edgefl_models.datasets import Dataset, DatasetError

SHAPE = (3, 8)


def settings(**values) -> DataSettings:
    s = DataSettings(**values)
    s.validate()
    return s


def batch(first: int, n: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Sample i has every x value equal to i, so a test can tell which samples it got back."""
    ids = np.arange(first, first + n)
    return np.repeat(ids, np.prod(SHAPE)).reshape(n, *SHAPE).astype(np.float32), (ids % 5).astype(np.int64)


def put(directory: Path, name: str, x: np.ndarray, y: np.ndarray) -> Path:
    """The writer's protocol: write a temp name, then rename."""
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    tmp = directory / f"{name}.tmp"
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, directory / name)
    return directory / name


def ids(data: Dataset) -> set[int]:
    return set(data.x[:, 0, 0].astype(int).tolist())


def spool_source(tmp_path: Path, **values):
    directory = tmp_path / "spool"
    directory.mkdir(exist_ok=True)
    values = {"window": 40, "holdout": 0.0, "state_dir": str(tmp_path / "state"), **values}
    return directory, open_source(settings(source="spool", path=str(directory), **values), "classification")


# -- npz and csv -------------------------------------------------------------------------------------

def test_npz_reads_classification_and_float_regression(tmp_path):
    x, y = batch(0, 50)
    np.savez(tmp_path / "c.npz", x=x, y=y)
    local = open_source(settings(path=str(tmp_path / "c.npz"), holdout=0.2), "classification").read()
    assert len(local.train) + len(local.held_out) == 50 and 0 < len(local.held_out) < 25
    assert not ids(local.train) & ids(local.held_out)
    np.testing.assert_array_equal(local.train.y, np.array(sorted(ids(local.train))) % 5)
    np.savez(tmp_path / "r.npz", x=x, y=np.linspace(0, 1, 50).reshape(50, 1))
    regression = open_source(settings(path=str(tmp_path / "r.npz"), holdout=0.0), "regression").read()
    assert regression.train.y.dtype == np.float32 and regression.train.y.shape == (50, 1)
    assert len(regression.held_out) == 0


def test_npz_problems_are_specific_errors_and_a_fixed_file_reads(tmp_path):
    path = tmp_path / "d.npz"
    source = open_source(settings(path=str(path)), "classification")
    with pytest.raises(DataError, match="does not exist"):
        source.read()
    x, y = batch(0)
    np.savez(path, x=x, y=y.astype(np.float32))
    with pytest.raises(DataError, match="classification needs integer class labels"):
        source.read()
    x[3, 0, 0] = np.nan
    np.savez(path, x=x, y=y)
    with pytest.raises(DataError, match=r"NaN or inf in 1 samples \(first: sample 3\)"):
        source.read()
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DatasetError, match="truncated"):  # DataError is a DatasetError, as load_npz raised
        source.read()
    np.savez(path, x=batch(0)[0], y=y)
    assert len(source.read().train) > 0


def write_csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_csv_reads_by_label_name_and_reshapes(tmp_path):
    path = write_csv(tmp_path / "d.csv", "a,label,b,c,d\n1,0,2,3,4\n5,1,6,7,8\n9,2,10,11,12\n")
    local = open_source(settings(source="csv", path=str(path), holdout=0.0, shape=[2, 2]), "classification").read()
    np.testing.assert_array_equal(local.train.x[1], [[5, 6], [7, 8]])
    np.testing.assert_array_equal(local.train.y, [0, 1, 2])
    target = write_csv(tmp_path / "r.csv", "t,x1\n0.5,1\n-1.25,2\n")
    regression = open_source(settings(source="csv", path=str(target), label_column="t", holdout=0.0),
                             "regression").read()
    np.testing.assert_allclose(regression.train.y, [0.5, -1.25])
    assert regression.train.x.shape == (2, 1)


@pytest.mark.parametrize("text,message", [
    ("a,b\n1,2\n", r"no column 'label' \(columns: a, b\); set \[data\] label_column"),
    ("a,label\n1,0\nx7,1\n", r"line 3, column 'a': 'x7' is not a number"),
    ("a,label\n1,0\n2,2.5\n", r"line 3, column 'label': '2.5' is not an integer class label"),
    ("a,label\n1,0\n2,3,4\n", r"line 3 has 3 cells, the header has 2"),
    ("a,label\n1,0\nnan,1\n", r"NaN or inf"),
    ("a,b,c,label\n1,2,3,0\n", r"cannot be reshaped to \[data\] shape = \[2, 2\]"),
])
def test_csv_errors_name_line_and_column(tmp_path, text, message):
    path = write_csv(tmp_path / "bad.csv", text)
    shape = [2, 2] if "a,b,c" in text else []
    with pytest.raises(DataError, match=message):
        open_source(settings(source="csv", path=str(path), shape=shape), "classification").read()


# -- images ------------------------------------------------------------------------------------------

def test_image_folder_classes_sizes_and_a_broken_image(tmp_path, caplog):
    from PIL import Image
    for label, name in enumerate(["cat", "dog"]):
        (tmp_path / name).mkdir()
        for i in range(3):
            colour = (255 * label, 0, 0) if i else (0, 0, 0)
            Image.new("RGB", (40, 30), colour).save(tmp_path / name / f"{i}.png")
    (tmp_path / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    source = open_source(settings(source="images", path=str(tmp_path), image_size=[8, 6], channels=3, holdout=0.0),
                         "classification")
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        local = source.read()
    assert local.train.x.shape == (6, 3, 8, 6) and local.train.x.dtype == np.float32
    np.testing.assert_array_equal(local.train.y, [0, 0, 0, 1, 1, 1])
    assert local.train.x[4, 0].max() == pytest.approx(1.0)  # a red dog, scaled to [0, 1]
    assert source.skipped["unreadable"] == 1
    assert [r.message for r in caplog.records if "broken.png" in r.message and "unreadable" in r.message]
    gray = open_source(settings(source="images", path=str(tmp_path), image_size=[4, 4]), "classification").read()
    assert gray.train.x.shape[1:] == (1, 4, 4)


def test_image_folder_without_pillow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DataError, match=r"pip install 'edgefl\[images\]'"):
        open_source(settings(source="images", path=str(tmp_path)), "classification").read()


# -- spool -------------------------------------------------------------------------------------------

def test_spool_reads_only_new_files_and_keeps_the_newest_window(tmp_path):
    directory, source = spool_source(tmp_path)
    for i in range(3):
        put(directory, f"{i:03}.npz", *batch(10 * i))
    (directory / "zz.npz.tmp").write_bytes(b"half written")
    (directory / ".004.npz").write_bytes(b"half written")
    assert ids(source.read().train) == set(range(30)) and source.new_files == 3
    assert source.read().train.x.shape == (30, *SHAPE) and source.new_files == 0
    for i in range(3, 7):
        put(directory, f"{i:03}.npz", *batch(10 * i))
    local = source.read()
    assert ids(local.train) == set(range(30, 70)) and source.samples == 40 and source.new_files == 4
    assert sorted(p.name for p in (directory / "consumed").iterdir()) == [f"{i:03}.npz" for i in range(7)]
    assert {p.name for p in directory.iterdir()} == {"consumed", "zz.npz.tmp", ".004.npz"}
    assert not source.skipped
    put(directory, "big.npz", *batch(100, 55))  # one file larger than the window: its newest rows
    assert ids(source.read().train) == set(range(115, 155))


def test_spool_window_trims_a_file_partly_and_restarts_without_rereading(tmp_path):
    directory, source = spool_source(tmp_path, window=25, holdout=0.3)
    for i in range(3):
        put(directory, f"{i}.npz", *batch(10 * i))
    first = source.read()
    assert ids(first.train) | ids(first.held_out) == set(range(5, 30))
    again = open_source(settings(source="spool", path=str(directory), window=25, holdout=0.3,
                                 state_dir=str(tmp_path / "state")), "classification")  # a restarted agent
    restored = again.read()
    assert again.new_files == 0
    assert (ids(restored.train), ids(restored.held_out)) == (ids(first.train), ids(first.held_out))
    put(directory, "3.npz", *batch(30))
    later = again.read()
    assert ids(later.train) | ids(later.held_out) == set(range(15, 40))
    assert not (ids(later.train) & ids(first.held_out))  # held out once, never trained later


def test_spool_restart_after_an_interrupted_move_does_not_count_a_file_twice(tmp_path):
    directory, source = spool_source(tmp_path)
    put(directory, "a.npz", *batch(0))
    source.read()
    os.replace(directory / "consumed" / "a.npz", directory / "a.npz")  # as if the agent died before the move
    _, restarted = spool_source(tmp_path)
    assert len(restarted.read().train) == 10 and restarted.files_read == 0
    assert (directory / "consumed" / "a.npz").exists() and not (directory / "a.npz").exists()


def test_spool_holdout_is_stable_per_file_and_row():
    a = held_out_mask("0042.npz", 0, 1000, 0.2)
    assert 150 < a.sum() < 250
    np.testing.assert_array_equal(held_out_mask("0042.npz", 400, 600, 0.2), a[400:])
    assert not np.array_equal(held_out_mask("0043.npz", 0, 1000, 0.2), a)


def truncated(x, y) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    return buffer.getvalue()[:-100]


def test_spool_skips_each_bad_file_once_with_a_reason_and_keeps_working(tmp_path, caplog):
    directory, source = spool_source(tmp_path)
    put(directory, "000.npz", *batch(0))
    x, y = batch(10)
    nan = x.copy()
    nan[2] = np.nan
    bad = {
        "001.npz": lambda p: put(directory, p, x[:, :2], y),  # (2, 8) after the first file's (3, 8)
        "002.npz": lambda p: put(directory, p, x, y.astype(np.float64)),
        "003.npz": lambda p: put(directory, p, x.astype(np.complex64), y),
        "004.npz": lambda p: put(directory, p, nan, y),
        "005.npz": lambda p: (directory / p).write_bytes(truncated(x, y)),
        "006.csv": lambda p: (directory / p).write_text("a,label\n1,0\n2,x\n"),
        "007.csv": lambda p: (directory / p).write_text("a,b\n1,0\n"),
    }
    reasons = {"001.npz": "wrong_shape", "002.npz": "label_type", "003.npz": "wrong_dtype", "004.npz": "not_finite",
               "005.npz": "unreadable", "006.csv": "label_type", "007.csv": "missing_label_column"}
    for name, write in bad.items():
        write(name)
    put(directory, "008.npz", *batch(20))
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        local = source.read()
        assert ids(local.train) == set(range(10)) | set(range(20, 30))
        for name, reason in reasons.items():
            lines = [r.message for r in caplog.records if name in r.message]
            assert len(lines) == 1 and f"({reason})" in lines[0], (name, lines)
        assert sorted(p.name for p in (directory / "rejected").iterdir()) == sorted(bad)
        caplog.clear()
        put(directory, "009.npz", *batch(30))
        assert ids(source.read().train) == set(range(10)) | set(range(20, 40))
        assert not caplog.records  # rejected files are not retried
    assert source.skipped == {"wrong_shape": 1, "label_type": 2, "wrong_dtype": 1, "not_finite": 1,
                              "unreadable": 1, "missing_label_column": 1}
    assert "7 skipped" in source.describe()


def test_spool_oversized_file_is_refused_unread(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(spool, "MAX_FILE_BYTES", 1000)
    directory, source = spool_source(tmp_path)
    put(directory, "small.npz", *batch(0, 1))
    put(directory, "large.npz", *batch(1, 50))
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        assert ids(source.read().train) == {0}
    assert source.skipped == {"oversized": 1} and "exceeds" in caplog.records[0].message


def test_spool_missing_then_empty_then_csv_batches(tmp_path):
    directory = tmp_path / "spool"
    source = open_source(settings(source="spool", path=str(directory), shape=[2], holdout=0.0), "regression")
    with pytest.raises(DataError, match="does not exist yet"):
        source.read()
    directory.mkdir()
    with pytest.raises(DataError, match="no samples yet"):
        source.read()
    (directory / "a.csv").write_text("f1,f2,label\n1,2,0.5\n3,4,1.5\n")
    local = source.read()
    np.testing.assert_allclose(local.train.y, [0.5, 1.5])
    assert local.train.x.shape == (2, 2)


def test_spool_keep_mode_leaves_files_and_a_restart_reads_only_new_ones(tmp_path, caplog):
    directory, source = spool_source(tmp_path, consume="keep")
    put(directory, "a.npz", *batch(0))
    (directory / "b.npz").write_bytes(b"PK broken")
    with caplog.at_level(logging.WARNING, logger="edge_agent.data"):
        assert ids(source.read().train) == set(range(10))
        assert ids(source.read().train) == set(range(10)) and source.new_files == 0
    assert sorted(p.name for p in directory.iterdir()) == ["a.npz", "b.npz"]
    assert len([r for r in caplog.records if "b.npz" in r.message]) == 1
    restarted = open_source(settings(source="spool", path=str(directory), window=40, holdout=0.0, consume="keep",
                                     state_dir=str(tmp_path / "state")), "classification")
    assert ids(restarted.read().train) == set(range(10)) and restarted.new_files == 0
    put(directory, "c.npz", *batch(10))
    assert ids(restarted.read().train) == set(range(20)) and restarted.new_files == 1


@pytest.mark.parametrize("consume", ["move", "delete", "keep"])
def test_spool_backlog_reads_only_the_newest_window(tmp_path, consume):
    directory, source = spool_source(tmp_path, consume=consume)
    for i in range(20):
        put(directory, f"{i:03}.npz", *batch(10 * i))
        os.utime(directory / f"{i:03}.npz", ns=(i * 10**9, i * 10**9))  # the writer's order, whatever the clock did
    (directory / "000.npz").write_bytes(b"broken, but too old to matter")
    os.utime(directory / "000.npz", ns=(0, 0))
    assert ids(source.read().train) == set(range(160, 200))
    assert (source.files_read, source.not_read, sum(source.skipped.values())) == (4, 16, 0)
    assert source.read().train.x.shape[0] == 40 and source.new_files == 0
    left = {p.name for p in directory.glob("*.npz")} | {p.name for p in directory.glob("consumed/*.npz")}
    assert len(left) == {"move": 20, "keep": 20, "delete": 4}[consume]


def test_spool_delete_mode_keeps_only_the_windows_files(tmp_path):
    directory, source = spool_source(tmp_path, consume="delete", window=20)
    for i in range(5):
        put(directory, f"{i}.npz", *batch(10 * i))
        source.read()
    assert sorted(p.name for p in (directory / "consumed").iterdir()) == ["3.npz", "4.npz"]


# -- check_fits --------------------------------------------------------------------------------------

def test_check_fits_accepts_matching_data():
    x, y = batch(0)
    check_fits(Dataset(x, y), SHAPE, "classification", 5)
    check_fits(Dataset(x, np.zeros(10, np.float32)), SHAPE, "regression", 1)
    check_fits(Dataset(x, np.zeros((10, 1), np.float32)), SHAPE, "regression", 1)
    check_fits(Dataset(x, np.zeros((10, 3), np.float32)), SHAPE, "regression", 3)


@pytest.mark.parametrize("x_shape,y,task,outputs,message", [
    ((10, 8, 3), np.zeros(10, np.int64), "classification", 5,
     r"x has samples of shape \(8, 3\) but model m:build expects \(3, 8\) \(the same axes in another order: "
     r"transpose the samples\): fix the files under /data/spool"),
    ((10, 24), np.zeros(10, np.int64), "classification", 5, r"set \[data\] shape = \[3, 8\]"),
    ((10, 3, 8), np.full(10, 7), "classification", 5, r"labels 7..7 but model m:build has 5 classes \(0..4\)"),
    ((10, 3, 8), np.zeros(10, np.float32), "classification", 5, r"needs one integer label 0..4"),
    ((10, 3, 8), np.zeros(10, np.int64), "regression", 1, r"needs float targets"),
    ((10, 3, 8), np.zeros((10, 2), np.float32), "regression", 1, r"targets of shape \(2,\) but model m:build predicts 1"),
    ((10, 3, 8), np.zeros(10, np.float32), "regression", 3, r"predicts 3 values"),
])
def test_check_fits_rejects_with_an_actionable_line(x_shape, y, task, outputs, message):
    data = Dataset(np.zeros(x_shape, np.float32), y)
    with pytest.raises(DataMismatch, match=message) as raised:
        check_fits(data, SHAPE, task, outputs, model="m:build", where="/data/spool")
    assert isinstance(raised.value, ValueError) and "\n" not in str(raised.value)


def test_check_fits_rejects_nan():
    x, y = batch(0)
    x[0, 0, 0] = np.inf
    with pytest.raises(DataMismatch, match="1 NaN/inf"):
        check_fits(Dataset(x, y), SHAPE, "classification", 5)


# -- config ------------------------------------------------------------------------------------------

BASE = '[broker]\nhost = "h"\nport = 1883\nusername = "d"\npassword = "p"\n[device]\nid = "d"\nstate_dir = "/s"\n'


def config(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(BASE + extra)
    return path


def test_config_data_section_and_legacy_device_data(tmp_path, monkeypatch):
    c = load_config(config(tmp_path, '[data]\nsource = "spool"\npath = "/sp"\nshape = [3, 128]\nconsume = "keep"\n'))
    assert (c.data.source, c.data.shape, c.data.window, c.data.holdout, c.data.state_dir) == \
        ("spool", (3, 128), 5000, 0.2, "/s")
    legacy = load_config(config(tmp_path, 'data = "/x.npz"\n'))
    assert (legacy.data.source, legacy.data.path, legacy.data.holdout) == ("npz", "/x.npz", 0.0)
    monkeypatch.setenv("EDGEFL_AGENT_DATA_SHAPE", "3,64")
    monkeypatch.setenv("EDGEFL_AGENT_DATA_WINDOW", "100")
    c = load_config(config(tmp_path, '[data]\nsource = "csv"\npath = "/d.csv"\n'))
    assert (c.data.shape, c.data.window) == ((3, 64), 100)


@pytest.mark.parametrize("extra,message", [
    ('data = "/x.npz"\n[data]\npath = "/y.npz"\n', r"both \[device\] data and \[data\]"),
    ("", r"no local data configured: add a \[data\] section"),
    ('[data]\nsource = "parquet"\npath = "/p"\n', r"\[data\]: source must be one of npz, csv, images, spool"),
    ('[data]\npath = "/p"\nwindow = 0\n', r"\[data\]: window must be at least 1"),
    ('[data]\npath = "/p"\nholdout = 1.0\n', r"\[data\]: holdout must be a fraction"),
    ('[data]\npath = "/p"\nshape = [3, "x"]\n', r"\[data\]: shape must be a list of positive integers"),
    ('[data]\npath = "/p"\nconsume = "eat"\n', r"\[data\]: consume must be one of move, delete, keep"),
    ('[data]\npath = "/p"\nchannels = 2\n', r"\[data\]: channels must be 1"),
    ('[data]\nsource = "npz"\n', r"\[data\]: path is required"),
    ('[data]\npath = "/p"\nwindw = 5\n', r"\[data\]: unknown key\(s\) windw"),
])
def test_config_errors_name_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config(tmp_path, extra))


def test_open_source_refuses_images_for_regression_and_unknown_tasks(tmp_path):
    with pytest.raises(DataError, match="cannot feed a regression model"):
        open_source(settings(source="images", path=str(tmp_path)), "regression")
    with pytest.raises(ValueError, match="task must be one of"):
        open_source(settings(path=str(tmp_path)), "ranking")


def test_npz_members_that_inflate_past_the_limit_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 1000)
    np.savez_compressed(tmp_path / "zeros.npz", x=np.zeros((100, 3, 8), np.float32), y=np.zeros(100, np.int64))
    with pytest.raises(DataError, match="exceed the 0 MB limit") as raised:
        open_source(settings(path=str(tmp_path / "zeros.npz")), "classification").read()
    assert raised.value.reason == "oversized"
