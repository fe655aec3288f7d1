"""Thousands of emulated devices in one process, on one thread: real MQTT v5 clients with their own
credentials that behave as an agent does on the wire, without training.

A device publishes its retained online status (with a will that clears it), subscribes to its
task, its receipts and the model manifests; on a task it fetches that model version's retained
chunks if it does not hold it (counting them against the manifest, not assembling them), then
publishes a precomputed update re-signed for the task's round, version and attempt. `bench/swarm.py`
runs one paho thread per client, which does not reach 10,000 clients; here one `selectors` loop
drives every client's socket (paho's loop_read / loop_write / loop_misc).

    python bench/crowd.py SPEC.json     # prints "ready N" once every client is connected
"""

from __future__ import annotations

import hashlib
import json
import selectors
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402
import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from edgefl_protocol import messages, topics  # noqa: E402
from edgefl_protocol.errors import Rejected  # noqa: E402

BATCH = 200  # connects in flight at once (the broker's accept backlog is finite)


def device_key(device: str) -> bytes:
    return hashlib.sha256(f"edgefl-bench-crowd/{device}".encode()).digest()


class Device:
    def __init__(self, name: str, password: str, crowd: "Crowd") -> None:
        self.name, self.crowd = name, crowd
        self.key = device_key(name)
        self.held = -1  # model version held
        self.waiting: messages.Task | None = None
        self.chunks: dict[int, set[int]] = {}
        self.connected = False
        c = self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
        c.username_pw_set(name, password)
        c.will_set(topics.status(crowd.fed, name), b"", qos=1, retain=True)
        c.on_connect, c.on_message = self.on_connect, self.on_message

    def on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            print(f"{self.name}: refused: {reason_code}", file=sys.stderr, flush=True)
            return
        fed = self.crowd.fed
        client.subscribe([(topics.task(fed, self.name), 1), (topics.receipt(fed, self.name), 1),
                          (topics.models(fed), 1)])
        client.publish(topics.status(fed, self.name), messages.encode("status", messages.Status(self.name, "online")),
                       qos=1, retain=True)
        self.connected = True
        self.crowd.writers.add(self)

    def on_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        fed = self.crowd.fed
        if not msg.payload:
            return
        if (version := topics.parse_model_topic(msg.topic)) is not None:
            try:
                self.crowd.manifests[version] = messages.decode_model(msg.payload, 1 << 30).chunks
            except Rejected:
                pass
        elif (where := topics.parse_model_chunk_topic(msg.topic)) is not None:
            version, index = where
            got = self.chunks.setdefault(version, set())
            got.add(index)
            if len(got) >= self.crowd.manifests.get(version, 1 << 30):
                self.held = version
                self.chunks.pop(version, None)
                client.unsubscribe(topics.model_chunks(fed, version))
                self.crowd.writers.add(self)
                if self.waiting is not None and self.waiting.model_version == version:
                    self.answer(self.waiting)
        elif msg.topic.endswith("/task"):
            task = messages.decode_task(msg.payload)
            if not self.crowd.fetch or self.held == task.model_version:
                self.answer(task)
            else:
                self.waiting = task
                client.subscribe(topics.model_chunks(fed, task.model_version), qos=1)
                self.crowd.writers.add(self)
        elif msg.topic.endswith("/receipt"):
            self.crowd.receipts += 1

    def answer(self, task: messages.Task) -> None:
        body = self.crowd.body
        update = messages.Update(self.name, task.round, task.model_version, 100, {"steps": 4}, body["body"],
                                 body["codec"], body["specs"], self.crowd.fed, task.attempt)
        self.client.publish(topics.update(self.crowd.fed, self.name), messages.encode_update(update, self.key), qos=1)
        self.waiting = None
        self.crowd.answered += 1
        self.crowd.writers.add(self)


class Crowd:
    def __init__(self, spec: dict) -> None:
        self.fed, self.fetch = spec["federation"], bool(spec.get("fetch_model", True))
        self.host, self.port = spec["host"], spec["port"]
        self.body = msgpack.unpackb(Path(spec["body_file"]).read_bytes())
        self.manifests: dict[int, int] = {}
        self.devices = [Device(name, password, self) for name, password in spec["devices"]]
        self.selector = selectors.DefaultSelector()
        self.answered = self.receipts = 0
        self.writers: set[Device] = set()  # devices with packets queued by their callbacks
        self.stopping = False

    def pump(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            device: Device = key.data
            if device.client.loop_read(100) != mqtt.MQTT_ERR_SUCCESS:
                self._drop(device)
                continue
        for device in list(self.writers):  # what callbacks queued, or a socket buffer did not take at once
            if device.client.want_write():
                device.client.loop_write()
            if not device.client.want_write():
                self.writers.discard(device)

    def _drop(self, device: Device) -> None:
        try:
            self.selector.unregister(device.client.socket())
        except (KeyError, ValueError, TypeError):
            pass
        print(f"{device.name}: connection lost", file=sys.stderr, flush=True)

    def connect_all(self) -> None:
        for start in range(0, len(self.devices), BATCH):
            batch = self.devices[start:start + BATCH]
            for device in batch:
                device.client.connect(self.host, self.port, keepalive=900)
                self.selector.register(device.client.socket(), selectors.EVENT_READ, device)
            give_up = time.monotonic() + 120
            while not all(d.connected for d in batch):
                if time.monotonic() > give_up:
                    raise TimeoutError(f"{sum(not d.connected for d in batch)} clients got no CONNACK in 120 s")
                self.pump(0.1)

    def run(self) -> None:
        self.connect_all()
        print(f"ready {len(self.devices)}", flush=True)
        last_misc = time.monotonic()
        while not self.stopping:
            self.pump(0.05)
            if time.monotonic() - last_misc > 20:
                for device in self.devices:
                    device.client.loop_misc()
                last_misc = time.monotonic()
        for device in self.devices:  # clear the retained status, as an agent's last words do
            device.client.publish(topics.status(self.fed, device.name), b"", qos=0, retain=True)
            device.client.disconnect()
            device.client.loop_write()


def main(spec_path: str) -> int:
    crowd = Crowd(json.loads(Path(spec_path).read_text()))
    signal.signal(signal.SIGTERM, lambda *_: setattr(crowd, "stopping", True))
    crowd.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
