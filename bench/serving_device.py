"""`make serving`, on one device: prediction latency through `edge-agent serve` under a Pi 4's CPU, and
swaps of the serving store under concurrent predictions.

A Pi 4 is emulated as one cgroup with its class's CPU (4 cores x the class's speed, fleet.PROFILES) and
memory; inside it, `edge-agent serve` and the trainer get the CPU shares their systemd units give them
(systemd/edge-agent-serve.service: CPUWeight=100, Nice=0, one torch thread; systemd/edge-agent.service:
CPUWeight=20, Nice=10, batch scheduling, the agent's default of 3 threads on 4 cores). The trainer is a
real local training loop of the model being served (SGD on MNIST-5k batches), running until stopped.

Swaps: version after version published into a store (`ServingStore.publish`, keep 3) while clients
ask `edge-agent serve` over its socket and an in-process `ServedModel` predicts. Version v is built to
answer class v % 10 for every input, so an answer whose predictions do not match the version it names
is a torn read; an error answer is a partial one.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from broker_coordinator.simulation.fleet import PROFILES, CgroupUnavailable, Cgroups, join_command
from edge_agent.serving import ServeError, ServedModel, predict_over_socket
from edge_agent.serving_store import ServingStore
from edgefl_models.architectures import build_model, fingerprint

ROOT = Path(__file__).resolve().parent.parent
PI_CORES = 4
SERVE_WEIGHT, TRAIN_WEIGHT = 100, 20  # the units' CPUWeight
TRAIN_THREADS = 3  # the agent's default on a 4-core device

TRAINER = """
import os, sys, torch
os.nice(10)
try:
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
except (AttributeError, OSError):
    pass
torch.set_num_threads(int(sys.argv[2]))
from edgefl_models.architectures import build_model
from edgefl_models import datasets
data = datasets.load_mnist5k().train
model = build_model(sys.argv[1])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.as_tensor(data.x), torch.as_tensor(data.y)
print("training", flush=True)
i = 0
while True:
    batch = slice((i * 32) % (len(x) - 32), (i * 32) % (len(x) - 32) + 32)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
    opt.step()
    i += 1
"""


class EmulatedPi:
    """A Pi-class device as cgroups: the device's CPU quota and memory, a serve and a train group inside."""

    def __init__(self, device_class: str) -> None:
        profile = PROFILES[device_class]
        self.cores = PI_CORES * profile.speed
        self.note = f"{device_class}: {PI_CORES} cores x {profile.speed:.2f} = {self.cores:.2f} host cores, " \
                    f"{profile.memory_limit_mb} MB"
        self.groups: Cgroups | None = None
        self.procs: dict[str, list[Path]] = {"serve": [], "train": []}
        try:
            self.groups = Cgroups(f"edgefl-serving-{os.getpid()}")
            self.groups.limit("device", self.cores, profile.memory_limit_mb)
            for name, weight in (("serve", SERVE_WEIGHT), ("train", TRAIN_WEIGHT)):
                self.procs[name] = self.groups.share("device", name, weight)
        except (CgroupUnavailable, OSError) as exc:
            self.note += f"; not applied ({exc}): unlimited"
            self.close()

    def command(self, name: str, argv: list[str]) -> list[str]:
        return join_command(self.procs[name], argv) if self.procs[name] else argv

    def close(self) -> None:
        if self.groups is not None:
            self.groups.remove()
            self.groups = None
            self.procs = {"serve": [], "train": []}


def start_serve(store: Path, socket_path: Path, command) -> subprocess.Popen:  # noqa: ANN001 - EmulatedPi.command
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = command("serve", [sys.executable, "-m", "edge_agent", "serve", "--dir", str(store),
                             "--socket", str(socket_path), "--threads", "1"])
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    give_up = time.monotonic() + 120
    while not socket_path.exists():
        if process.poll() is not None or time.monotonic() > give_up:
            process.kill()
            raise RuntimeError(f"edge-agent serve did not start: {process.stderr.read().decode()[-800:]}")
        time.sleep(0.05)
    return process


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def latencies(socket_path: Path, x: np.ndarray, requests: int) -> list[float]:
    """Milliseconds per single-sample request through `predict_over_socket`, as an application asks."""
    for i in range(20):  # warm-up: torch's first calls, the page cache
        predict_over_socket(socket_path, x[i % len(x)][None])
    out = []
    for i in range(requests):
        started = time.perf_counter()
        predict_over_socket(socket_path, x[i % len(x)][None])
        out.append((time.perf_counter() - started) * 1000)
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 2), "p99": round(ordered[int(0.99 * (len(ordered) - 1))], 2),
            "requests": len(ordered)}


def latency(arch: str = "mnist_cnn", device_class: str = "pi4", requests: int = 500) -> dict:
    from edgefl_models import datasets
    x = datasets.load_mnist5k().test.x[:100]
    pi = EmulatedPi(device_class)
    work = Path(tempfile.mkdtemp(prefix="edgefl-serving-latency-"))
    os.chmod(work, 0o755)  # the cgroup'd processes are root too; nothing else needs it
    store = ServingStore(work / "store")
    model = build_model(arch)
    store.publish(1, model.state_dict(), {"architecture": arch, "fingerprint": fingerprint(model),
                                          "task": "classification", "round": 1})
    serve = start_serve(work / "store", work / "serve.sock", pi.command)
    result: dict = {"device": pi.note, "model": arch}
    try:
        result["idle"] = percentiles(latencies(work / "serve.sock", x, requests))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        trainer = subprocess.Popen(pi.command("train", [sys.executable, "-c", TRAINER, arch, str(TRAIN_THREADS)]),
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            if trainer.stdout.readline().strip() != b"training":
                raise RuntimeError(f"the trainer did not start: {trainer.stderr.read().decode()[-800:]}")
            time.sleep(2)  # its first steps: the load is on
            cpu_before = _cpu_seconds(trainer.pid)
            started = time.monotonic()
            result["training"] = percentiles(latencies(work / "serve.sock", x, requests))
            result["trainer_cpu_share"] = round((_cpu_seconds(trainer.pid) - cpu_before) /
                                                (time.monotonic() - started), 2)
        finally:
            stop(trainer)
    finally:
        stop(serve)
        pi.close()
    return result


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def constant_model(arch: str, label: int) -> dict[str, torch.Tensor]:
    """Weights that answer `label` for every input: all zero but the last layer's bias."""
    state = {name: torch.zeros_like(t) for name, t in build_model(arch).state_dict().items()}
    last_bias = [name for name in state if name.endswith("bias")][-1]
    state[last_bias][label] = 10.0
    return state


def swaps(count: int = 1000, arch: str = "digits_mlp", clients: int = 2) -> dict:
    """`count` versions published while `clients` socket clients and one in-process reader predict."""
    work = Path(tempfile.mkdtemp(prefix="edgefl-serving-swaps-"))
    store = ServingStore(work / "store", keep=3)
    meta = {"architecture": arch, "fingerprint": fingerprint(build_model(arch)), "task": "classification"}
    store.publish(1, constant_model(arch, 1), {**meta, "round": 1})
    serve = start_serve(work / "store", work / "serve.sock", lambda _name, argv: argv)
    x = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    done = threading.Event()
    tally = {"reads": 0, "torn_reads": 0, "partial_reads": 0, "versions_seen": set()}
    lock = threading.Lock()

    def tally_read(version: int, predictions: list[int] | np.ndarray, error: str = "") -> None:
        with lock:
            tally["reads"] += 1
            if error:
                tally["partial_reads"] += 1
                tally.setdefault("errors", []).append(error[:200])
            elif any(int(p) != version % 10 for p in predictions):
                tally["torn_reads"] += 1
            else:
                tally["versions_seen"].add(version)

    def socket_client() -> None:
        while not done.is_set():
            try:
                answer = predict_over_socket(work / "serve.sock", x)
                tally_read(int(answer["version"]), answer["predictions"])
            except ServeError as exc:
                tally_read(-1, [], str(exc))

    def in_process() -> None:
        served = ServedModel(work / "store")
        while not done.is_set():
            try:
                model, metadata = served.current()
                with torch.no_grad():
                    tally_read(int(metadata["version"]), model(torch.as_tensor(x)).argmax(dim=1).numpy())
            except Exception as exc:  # noqa: BLE001 - any failure to read a whole version is what we count
                tally_read(-1, [], f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=socket_client) for _ in range(clients)] + [threading.Thread(target=in_process)]
    for t in threads:
        t.start()
    started = time.monotonic()
    try:
        for version in range(2, count + 2):
            store.publish(version, constant_model(arch, version % 10), {**meta, "round": version})
    finally:
        elapsed = time.monotonic() - started
        time.sleep(0.5)  # the last version is read too
        done.set()
        for t in threads:
            t.join()
        stop(serve)
    return {"count": count, "seconds": round(elapsed, 1), "reads": tally["reads"],
            "torn_reads": tally["torn_reads"], "partial_reads": tally["partial_reads"],
            "versions_seen": len(tally["versions_seen"]), "readers": f"{clients} socket clients and 1 ServedModel",
            "errors": tally.get("errors", [])[:5], "kept_versions": len(store.versions())}
