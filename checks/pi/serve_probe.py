"""The serve part of `make pi-check`: `edge-agent serve` in the emulated Pi's root, on the serving store its agent filled.

Host side (imported by checks/pi/pi_check.py): the store's current version (its metadata.json, the
sha256 of its model.pt), `edge-agent serve` started in the root under QEMU_CPU with its guest RSS
sampled (memory.PeakRss, qemu's own share subtracted; guest_memory.GuestRss adds the
guest's libraries qemu maps above 1 TiB), then asked from the host through the root's
/tmp (the root is a directory on the host, so the guest's socket is reachable at ROOT/tmp/...):
`{"op": "info"}`, single-sample predictions timed one by one with `edge_agent.serving.predict_over_socket`
(a new connection each, as that client makes), a batch compared with the same store's model run on the
host, a malformed request (answered with an error, the server keeps going); then a few requests from
inside the root with the guest's python (this file, run as a script there), then SIGTERM.

Guest side (this file copied into the root's /tmp/pi-check and run by the guest python):

    python serve_probe.py ask SOCKET INPUTS.npy N OUT.json

Emulation is about 90x slower than a real Pi: the latencies say that serving answers, not how fast a Pi does.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from broker_coordinator.simulation.processes import stop_processes

LATENCY_NOTE = ("measured under qemu-user emulation (the server emulated, the host's client native, a new Unix-socket "
                "connection per request) on a 2-core x86 host shared with other work; emulation is about 90x slower "
                "than a real Pi, so these latencies show that serving answers, they are not a Pi's latency and do not "
                "convert to one by a fixed factor")


def _ask_raw(path: Path | str, request: dict[str, Any] | bytes, timeout: float = 120.0) -> dict[str, Any]:
    """One request line, one answer line (errors returned as answers, not raised)."""
    line = request if isinstance(request, bytes) else json.dumps(request).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        conn.sendall(line + b"\n")
        with conn.makefile("rb") as answers:
            answer = answers.readline()
    return json.loads(answer) if answer else {"error": "closed without an answer"}


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    import numpy as np
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "mean_ms": None, "min_ms": None, "max_ms": None}
    a = np.asarray(values)
    return {"n": len(values), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "mean_ms": round(float(a.mean()), 2),
            "min_ms": round(float(a.min()), 2), "max_ms": round(float(a.max()), 2)}


def timed_requests(path: Path | str, samples, timeout: float = 120.0) -> tuple[list[float], list[Any], list[Any]]:
    """One `predict_over_socket` per sample: (latencies in ms, predictions, versions)."""
    from edge_agent.serving import predict_over_socket
    latencies, predictions, versions = [], [], []
    for sample in samples:
        started = time.perf_counter()
        answer = predict_over_socket(path, sample, timeout=timeout)
        latencies.append((time.perf_counter() - started) * 1000)
        predictions.append(answer["predictions"][0])
        versions.append(answer["version"])
    return latencies, predictions, versions


def store_state(store: Path) -> dict[str, Any]:
    """The store's versions and its current one's metadata.json, model.pt checked against its sha256."""
    state: dict[str, Any] = {"exists": store.is_dir()}
    if not store.is_dir():
        return state
    state["versions"] = sorted(int(p.name) for p in store.iterdir() if p.is_dir() and p.name.isdigit())
    try:
        target = os.readlink(store / "current")
    except OSError as exc:
        state["current"] = None
        state["error"] = f"no current link: {exc}"
        return state
    state["current"] = target
    try:
        meta = json.loads((store / target / "metadata.json").read_text())
        body = (store / target / "model.pt").read_bytes()
    except (OSError, ValueError) as exc:
        state["error"] = f"cannot read version {target}: {exc}"
        return state
    state["metadata"] = meta
    state["model_pt_bytes"] = len(body)
    state["sha256_ok"] = hashlib.sha256(body).hexdigest() == meta.get("sha256")
    return state


def test_inputs(n: int):
    """The first n samples (cycled) of the digits test set, the federation's data, and their labels."""
    import numpy as np

    from edgefl_models.datasets import load
    test = load("digits").test
    index = np.arange(n) % len(test)
    return test.x[index], test.y[index]


def check_serve(root: Path, cpu: str, argv_prefix: list[str], guest_config: str, store: Path, guest_python: str,
                work: Path, log: Path, echo, requests: int = 200, guest_requests: int = 20,
                startup_timeout: float = 1200) -> dict[str, Any]:
    """`edge-agent serve --config guest_config` in the root; the result's "ok" says it answered as it should."""
    import numpy as np

    from edge_agent.serving import ServedModel

    from . import root as pi_root
    from .guest_memory import GuestRss

    result: dict[str, Any] = {"requests": requests, "latency_note": LATENCY_NOTE}
    state = store_state(store)
    result["store"] = {k: v for k, v in state.items() if k != "metadata"}
    meta = state.get("metadata") or {}
    result["store_metadata"] = meta
    result["store_version"] = meta.get("version")
    if meta.get("version") is None or not state.get("sha256_ok"):
        result.update(ok=False, error=f"the serving store {store} holds no readable current version: {state}")
        return result

    guest_socket = f"/tmp/pi-check/serve-{cpu}.sock"
    host_socket = root / guest_socket.lstrip("/")
    if host_socket.is_socket():
        host_socket.unlink()
    argv = [*argv_prefix, "serve", "--config", guest_config, "--socket", guest_socket]
    result["command"] = " ".join(argv)
    serve_log = log.with_name(f"serve-{cpu}.log")
    with open(log, "a") as handle:
        handle.write(f"$ QEMU_CPU={cpu} {' '.join(argv)}  (its output: {serve_log.name})\n")
    handle = open(serve_log, "wb")
    started = time.monotonic()
    process = pi_root.guest(root, cpu, argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    handle.close()
    sampler = GuestRss(process.pid, root)
    sampler.start()
    try:
        while not host_socket.is_socket():
            if process.poll() is not None:
                raise RuntimeError(f"edge-agent serve exited ({process.returncode}) before listening")
            if time.monotonic() - started > startup_timeout:
                raise RuntimeError(f"edge-agent serve did not listen on {guest_socket} within {startup_timeout:.0f} s")
            time.sleep(0.5)
        result["seconds_to_listen"] = round(time.monotonic() - started, 1)
        echo(f"  serve listening on {guest_socket} after {result['seconds_to_listen']} s (host path {host_socket})")

        info = _ask_raw(host_socket, {"op": "info"})
        result["info"] = {k: info.get(k) for k in ("version", "input_shape", "error")}
        x, y = test_inputs(requests)
        t0 = time.perf_counter()  # the first prediction loads the version's model.pt
        first = _ask_raw(host_socket, {"x": x[0].tolist()})
        result["first_request_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        result["first_answer"] = first
        latencies, predicted, versions = timed_requests(host_socket, x)
        result["latency"] = percentiles(latencies)
        result["versions_answering"] = sorted(set(versions))
        result["accuracy_on_digits_test"] = round(float(np.mean(np.asarray(predicted) == y)), 4)
        host_model = ServedModel(store)  # the same version's files, run by this x86 host's torch
        expected = host_model.predict(x).tolist()
        result["agree_with_x86_single"] = round(float(np.mean(np.asarray(predicted) == np.asarray(expected))), 4)
        t0 = time.perf_counter()
        batch = _ask_raw(host_socket, {"x": x.tolist()})
        result["batch_request"] = {"samples": len(x), "ms": round((time.perf_counter() - t0) * 1000, 1),
                                   "error": batch.get("error")}
        if "predictions" in batch:
            result["batch_request"]["agree_with_x86"] = round(
                float(np.mean(np.asarray(batch["predictions"]) == np.asarray(expected))), 4)
        bad = _ask_raw(host_socket, {"x": [1.0, 2.0]})
        result["malformed_request_answer"] = bad.get("error", bad)

        # the on-device client: the guest python asks, as an application on the Pi would (client emulated too)
        np.save(work / "serve-inputs.npy", x[:guest_requests])
        guest_out = f"/tmp/pi-check/serve-guest-{cpu}.json"
        (root / guest_out.lstrip("/")).unlink(missing_ok=True)
        done = pi_root.run_guest(root, cpu, [guest_python, "/tmp/pi-check/serve_probe.py", "ask", guest_socket,
                                             "/tmp/pi-check/serve-inputs.npy", str(guest_requests), guest_out],
                                 timeout=1800)
        with open(log, "a") as handle:
            handle.write(f"$ guest client: serve_probe.py ask {guest_socket}\n{done.stdout}\n")
        guest_result = {"exit": done.returncode}
        if done.returncode == 0 and (root / guest_out.lstrip("/")).exists():
            got = json.loads((root / guest_out.lstrip("/")).read_text())
            guest_result.update(latency=percentiles(got["latencies_ms"]), versions=sorted(set(got["versions"])),
                                agree_with_x86=round(float(np.mean(np.asarray(got["predictions"])
                                                                   == np.asarray(expected[:guest_requests]))), 4),
                                note="client and server both emulated")
        else:
            guest_result["output"] = done.stdout[-800:]
        result["guest_client"] = guest_result
        counters = _ask_raw(host_socket, {"op": "info"}).get("counters")
        result["counters"] = counters
    except Exception as exc:  # a failed serve check is a result, reported with its reason
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop_processes([process], timeout=180)  # SIGTERM, as systemctl stop
        result["memory"] = sampler.stop()
        result["exit_after_sigterm"] = process.returncode
        result["socket_removed_on_stop"] = not host_socket.exists()
        result["log_tail"] = serve_log.read_text(errors="replace").strip().splitlines()[-4:]
        with open(log, "a") as handle:
            handle.write(f"(serve exit {process.returncode}; memory {result['memory']})\n")
    want = result.get("store_version")
    result["ok"] = bool("error" not in result and result.get("info", {}).get("version") == want
                        and result.get("versions_answering") == [want]
                        and result.get("latency", {}).get("n") == requests
                        and result.get("agree_with_x86_single") == 1.0
                        and result.get("guest_client", {}).get("exit") == 0
                        and result.get("guest_client", {}).get("versions") == [want]
                        and result.get("exit_after_sigterm") == 0)
    return result


def _guest_ask(sock: str, inputs: str, n: int, out: str) -> int:
    """In the root: n single-sample requests with the project's own client."""
    import numpy as np
    x = np.load(inputs)[:n]
    latencies, predictions, versions = timed_requests(sock, x)
    Path(out).write_text(json.dumps({"latencies_ms": latencies, "predictions": predictions, "versions": versions}))
    print(json.dumps({"n": len(latencies), "versions": sorted(set(versions))}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "ask":
        sys.exit(_guest_ask(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
