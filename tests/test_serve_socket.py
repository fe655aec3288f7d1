"""`edge-agent serve`, started as a real process on a temporary serving store: its answers match
torch's, every answer names one complete version while versions swap, bad requests get their one-line
error and the server keeps answering, SIGTERM stops it and removes the socket; and its unit file."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_agent.serve import MAX_SAMPLES, NO_MODEL
from edge_agent.serving import ServeError, predict_over_socket
from edge_agent.serving_store import ServingStore
from edgefl_models.architectures import build_model, fingerprint

from .test_systemd import ANALYZE, SYSTEMD, directives, needs_analyze, verify

ROOT = Path(__file__).resolve().parent.parent
ARCH = "digits_mlp"
BATCH = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)


def publish(store: ServingStore, version: int, task: str = "classification") -> torch.nn.Module:
    model = build_model(ARCH, seed=version).eval()
    store.publish(version, model.state_dict(), {"round": version, "architecture": ARCH, "task": task,
                                                "fingerprint": fingerprint(model), "score": None})
    return model


class Server:
    """`python -m edge_agent serve` on `store`; a test stops exactly this process."""

    def __init__(self, store: Path | None, sock: Path | None, env: dict[str, str] | None = None,
                 options: tuple[str, ...] = ()) -> None:
        args = [sys.executable, "-m", "edge_agent", "serve", *options]
        args += ["--dir", str(store)] if store else []
        args += ["--socket", str(sock)] if sock else []
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def wait_ready(self, sock: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # poll until it answers, no fixed sleep
            assert self.proc.poll() is None, self.proc.communicate()[1]
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(sock))
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"edge-agent serve did not listen on {sock} within {timeout} s")

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


@pytest.fixture
def served(tmp_path):
    store = ServingStore(tmp_path / "serving", keep=2)
    sock = tmp_path / "run" / "serve.sock"
    sock.parent.mkdir()
    server = Server(store.root, sock)
    try:
        server.wait_ready(sock)
        yield store, sock, server
    finally:
        server.stop()


class Connection:
    """One client connection, several requests on it (the protocol is one JSON line each way)."""

    def __init__(self, sock: Path) -> None:
        self.conn = socket.socket(socket.AF_UNIX)
        self.conn.settimeout(15)
        self.conn.connect(str(sock))
        self.answers = self.conn.makefile("rb")

    def ask(self, line: bytes | dict) -> dict:
        self.conn.sendall((json.dumps(line).encode() if isinstance(line, dict) else line) + b"\n")
        return json.loads(self.answers.readline())

    def close(self) -> None:
        self.answers.close()
        self.conn.close()


def test_answers_match_torch_and_name_the_version(served):
    store, sock, _ = served
    with pytest.raises(ServeError, match=re.escape(NO_MODEL)):
        predict_over_socket(sock, BATCH)
    model = publish(store, 1)
    with torch.no_grad():
        logits = model(torch.from_numpy(BATCH))
    answer = predict_over_socket(sock, BATCH, probabilities=True)
    assert answer["version"] == 1 and answer["predictions"] == logits.argmax(dim=1).tolist()
    assert np.allclose(answer["probabilities"], torch.softmax(logits, dim=1).numpy(), atol=1e-6)
    one = predict_over_socket(sock, BATCH[3])  # one sample: a list of one prediction
    assert one == {"version": 1, "predictions": [answer["predictions"][3]]}

    conn = Connection(sock)
    info = conn.ask({"op": "info"})
    assert info["version"] == 1 and info["input_shape"] == [64] and info["metadata"]["architecture"] == ARCH
    assert info["counters"]["no_model"] == 1 and info["counters"]["predictions"] == 2
    conn.close()

    regression = publish(store, 2, task="regression")  # a regression version answers the values themselves
    with torch.no_grad():
        values = regression(torch.from_numpy(BATCH)).numpy()
    answer = predict_over_socket(sock, BATCH)
    assert answer["version"] == 2 and np.allclose(answer["predictions"], values, atol=1e-5)


def test_concurrent_clients_during_swaps_get_whole_versions(served):
    store, sock, _ = served
    expected = {}

    def remember(version: int, model: torch.nn.Module) -> None:
        with torch.no_grad():
            expected[version] = torch.softmax(model(torch.from_numpy(BATCH)), dim=1).numpy()

    remember(0, publish(store, 0))
    models = {v: build_model(ARCH, seed=v).eval() for v in range(1, 31)}
    for version, model in models.items():  # known before any is published: a reader never waits on us
        remember(version, model)
    stop, answers, failures = threading.Event(), [], []

    def client() -> None:
        conn = Connection(sock)
        try:
            while not stop.is_set():
                answers.append(conn.ask({"x": BATCH.tolist(), "probabilities": True}))
        except Exception as exc:  # noqa: BLE001 - every failure is reported below
            failures.append(repr(exc))
        finally:
            conn.close()

    clients = [threading.Thread(target=client) for _ in range(3)]
    for thread in clients:
        thread.start()
    try:
        for version, model in models.items():
            store.publish(version, model.state_dict(), {"round": version, "architecture": ARCH,
                                                        "task": "classification", "fingerprint": fingerprint(model)})
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while not any(a.get("version") == 30 for a in answers[-6:]) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=20)
    assert failures == [] and len(answers) > 30
    versions = set()
    for answer in answers:
        assert "error" not in answer, answer
        version = answer["version"]
        versions.add(version)
        assert np.allclose(answer["probabilities"], expected[version], atol=1e-5), f"version {version} torn"
        assert answer["predictions"] == expected[version].argmax(axis=1).tolist()
    assert 30 in versions and len(versions) > 2  # the clients saw the swaps, and the last version


def test_each_bad_request_gets_its_error_and_the_server_keeps_answering(served):
    store, sock, server = served
    publish(store, 1)
    conn = Connection(sock)
    nan_batch = ("[[" + ", ".join(["NaN"] * 64) + "]]").encode()
    bad = {
        b"{not json": "malformed JSON",
        b"[1, 2]": "a request is a JSON object",
        b'{"op": "train"}': "unknown op",
        b'{"y": [1]}': "names its inputs",
        json.dumps({"x": [[1.0, 2.0]]}).encode(): "x has shape [1, 2]: expected a sample of shape [64]",
        json.dumps({"x": [[1.0] * 64, [1.0]]}).encode(): "not an array of numbers of one shape",
        b'{"x": ' + nan_batch + b"}": "NaN or infinity",
        b'{"x": [[' + b", ".join([b"1e400"] * 64) + b"]]}": "NaN or infinity",
        json.dumps({"x": [[0.0] * 64] * (MAX_SAMPLES + 1)}).encode(): f"at most {MAX_SAMPLES}",
        b'{"x": "' + b"a" * (5 * 1024 * 1024) + b'"}': "over 4 MB",
    }
    for line, message in bad.items():
        answer = conn.ask(line)
        assert set(answer) == {"error"} and message in answer["error"], (line[:60], answer)
        assert "\n" not in answer["error"]
        assert conn.ask({"x": BATCH[:2].tolist()})["version"] == 1  # the same connection goes on
    counters = conn.ask({"op": "info"})["counters"]
    assert counters["malformed"] == 4 and counters["shape"] == 2 and counters["not_finite"] == 2
    assert counters["too_large"] == 2 and counters["predictions"] == len(bad)
    conn.close()
    assert server.proc.poll() is None


def test_socket_mode_stale_socket_runtime_directory_and_sigterm(tmp_path):
    store = ServingStore(tmp_path / "serving")
    publish(store, 1)
    runtime = tmp_path / "run"
    runtime.mkdir()
    sock = runtime / "serve.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # a socket file nobody answers on, as a killed server leaves it
    stale.close()
    server = Server(store.root, None, env={"RUNTIME_DIRECTORY": str(runtime)})  # the default under systemd
    try:
        server.wait_ready(sock)
        assert oct(sock.stat().st_mode & 0o777) == oct(0o660)
        assert predict_over_socket(sock, BATCH)["version"] == 1
        idle = Connection(sock)  # a client connected and silent does not hold up the stop
        started = time.monotonic()
        code, err = server.stop()
        idle.close()
    finally:
        server.stop()
    assert code == 0 and not sock.exists() and time.monotonic() - started < 10, err
    assert "stopped; answered" in err and "Traceback" not in err


def test_a_second_server_on_a_live_socket_refuses_with_one_line(served):
    store, sock, _ = served
    result = subprocess.run([sys.executable, "-m", "edge_agent", "serve", "--dir", str(store.root), "--socket",
                             str(sock)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "another edge-agent serve is answering" in result.stderr
    assert "Traceback" not in result.stderr and sock.is_socket()


# the unit ----------------------------------------------------------------------------------------
def serve_unit() -> str:
    text = (SYSTEMD / "edge-agent-serve.service").read_text()
    return re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable} -m edge_agent", text, flags=re.M)


@needs_analyze
def test_serve_unit_passes_systemd_analyze_verify(tmp_path):
    assert ANALYZE
    result = verify(tmp_path, "edge-agent-serve.service", serve_unit())
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stderr


def test_serve_unit_is_hardened_read_only_and_ahead_of_the_trainer():
    d = directives((SYSTEMD / "edge-agent-serve.service").read_text())
    agent = directives((SYSTEMD / "edge-agent.service").read_text())
    for key in ("ProtectSystem", "ProtectHome", "NoNewPrivileges", "PrivateTmp", "Restart", "DynamicUser",
                "CapabilityBoundingSet", "UMask"):
        assert d[key] == agent[key], key
    assert int(d["Nice"][0]) < int(agent["Nice"][0]) and int(d["CPUWeight"][0]) > int(agent["CPUWeight"][0])
    assert d["RuntimeDirectory"] == ["edgefl-serve"] and d["ReadOnlyPaths"] == ["-/var/lib/edgefl-serving"]
    assert "LoadCredential" not in d and "StateDirectory" not in d  # reads no secret, writes nothing
    command = d["ExecStart"][0]
    assert " serve " in command and "--socket /run/edgefl-serve/serve.sock" in command and "--threads 1" in command


def test_config_names_the_store_and_a_last_line_without_newline_is_answered(tmp_path):
    from .test_serving_store import write_config
    store = ServingStore(tmp_path / "store")
    publish(store, 3)
    config = write_config(tmp_path, {"dir": str(store.root)})
    sock = store.root / "serve.sock"  # the default outside systemd
    server = Server(None, None, options=("--config", str(config)))
    try:
        server.wait_ready(sock)
        with socket.socket(socket.AF_UNIX) as conn:  # what `nc -U -N` does: send, shut the write side, read
            conn.connect(str(sock))
            conn.sendall(b'{"op": "info"}')
            conn.shutdown(socket.SHUT_WR)
            assert json.loads(conn.makefile("rb").readline())["version"] == 3
        assert ServingStore(store.root).versions() == [3]  # the socket is no version
    finally:
        code, err = server.stop()
    assert code == 0 and not sock.exists(), err
    off = write_config(tmp_path, {"dir": ""})
    result = subprocess.run([sys.executable, "-m", "edge_agent", "serve", "--config", str(off)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "keeps no serving store" in result.stderr and "Traceback" not in result.stderr
