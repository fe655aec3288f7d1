"""Lightweight simulated devices for the scale benchmark: real MQTT clients
with real credentials that answer every task at once with a precomputed
update (no training). Run as a process: `python bench/swarm.py SPEC.json`."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hashlib  # noqa: E402

import msgpack  # noqa: E402

from edgefl_protocol import messages, topics  # noqa: E402
from edgefl_protocol.transport import make_client  # noqa: E402

# What a real agent running the default algorithm (dynsam) reports with its update (edge_agent/training.py's
# train_* / epochs / steps / passes, dynsam's rho / alpha / sigma / gamma, edge_agent/agent.py's epochs_reason,
# download counters and model provenance), with values of a 100-sample shard trained for 4 epochs
AGENT_METRICS = {"train_loss": 0.42, "epochs": 4, "steps": 16, "passes": 20, "train_seconds": 1.9,
                 "rho": 0.05, "alpha": 0.1, "sigma": 0.012, "gamma": 0.61,
                 "epochs_reason": "speed 900 samples/s", "bytes_down": 0, "bytes_down_join": 0,
                 "model_via": "cache"}  # no model_sha: the swarm never fetches the model it would name


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    encoded = msgpack.unpackb(Path(spec["body_file"]).read_bytes())  # codec-encoded delta, shared by all devices
    fed, clients = spec["federation"], []
    connected = threading.Semaphore(0)

    for device, password in spec["devices"]:
        client = make_client(device, device, password)

        def on_connect(c, userdata, flags, reason_code, properties, device=device):  # noqa: ANN001
            c.subscribe(topics.task(fed, device), qos=1)
            c.publish(topics.status(fed, device), messages.encode("status", messages.Status(device, "online")),
                      qos=1, retain=True)
            connected.release()

        def on_message(c, userdata, msg, device=device):  # noqa: ANN001
            task = messages.decode_task(msg.payload)
            update = messages.Update(device, task.round, task.model_version, 100, AGENT_METRICS, encoded["body"],
                                     encoded["codec"], encoded["specs"], fed, task.attempt)
            key = hashlib.sha256(f"edgefl-bench-swarm/{device}".encode()).digest()  # = runtime.swarm_key
            c.publish(topics.update(fed, device), messages.encode_update(update, key), qos=1)

        client.on_connect, client.on_message = on_connect, on_message
        client.will_set(topics.status(fed, device), b"", qos=1, retain=True)
        client.connect(spec["host"], spec["port"], keepalive=120)
        client.loop_start()
        clients.append(client)
    for _ in clients:
        connected.acquire()
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    for client in clients:
        client.publish(topics.status(fed, client._client_id.decode()), b"", qos=1, retain=True)
        client.disconnect()
        client.loop_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
