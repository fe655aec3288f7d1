"""`edge-agent serve`: the device's current model, answering applications on a Unix socket.

A process of its own, apart from the training (systemd/edge-agent-serve.service runs it at a higher
CPU priority than the trainer), reading the serving store only: every request is answered by the
store's current version (`serving.ServedModel` follows the `current` link).

Protocol: newline-delimited JSON, one request per line, one answer per line, on one connection as
many as the client likes.

    {"x": [[...], ...]}                      -> {"version": 42, "predictions": [3, 7, ...]}
    {"x": [...one sample...]}                -> {"version": 42, "predictions": [3]}
    {"x": ..., "probabilities": true}        -> adds "probabilities": [[p0, p1, ...], ...] (classification)
    {"op": "info"}                           -> {"version": 42, "metadata": {...}, "input_shape": [...],
                                                 "counters": {...}}
    anything wrong                           -> {"error": "one line saying what"}

`predictions` are classes for a classification model, values for a regression one (a list per
sample when the model has several outputs). An error never stops the server; each kind is counted
(`counters` in the info answer, and logged at shutdown).
"""

from __future__ import annotations

import argparse
import grp
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .enroll import DEFAULT_CONFIG

log = logging.getLogger("edge_agent.serve")
SOCKET_NAME = "serve.sock"
SYSTEMD_SOCKET = Path("/run/edgefl-serve") / SOCKET_NAME  # RuntimeDirectory=edgefl-serve of the unit
MAX_LINE = 4 * 1024 * 1024  # bytes in one request line
MAX_SAMPLES = 1024  # samples in one request
MAX_CLIENTS = 16  # connections served at once; more are told so and closed
IDLE_TIMEOUT = 300.0  # seconds a connection may stay silent
POLL = 0.5  # seconds between checks for SIGTERM in blocking calls
NO_MODEL = "no model yet: the device has not received one"


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="answer predictions of the current model on a Unix socket (JSON lines)",
                           description="Serve the serving store's current version to local applications: one "
                                       "JSON request per line on a Unix socket, answered with the version and "
                                       "its predictions (protocol: docs/OPERATOR.md, 'Using the model on the "
                                       "device'). Reads the store only; stops on SIGTERM.")
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                       help="the agent config naming the store ([serving] dir and group) (default: %(default)s)")
    serve.add_argument("--dir", type=Path, default=None,
                       help="the serving store itself, instead of reading it from --config")
    serve.add_argument("--socket", type=Path, default=None,
                       help=f"where to listen (default: $RUNTIME_DIRECTORY/{SOCKET_NAME} under systemd, "
                            f"i.e. {SYSTEMD_SOCKET}; otherwise DIR/{SOCKET_NAME})")
    serve.add_argument("--group", default=None,
                       help="local group allowed to connect (socket mode 0660) (default: [serving] group "
                            "of --config; none with --dir)")
    serve.add_argument("--threads", type=int, default=1,
                       help="torch CPU threads for inference, kept low so serving does not take the cores "
                            "training uses (default: %(default)s)")
    serve.add_argument("--max-clients", type=int, default=MAX_CLIENTS,
                       help="connections served at once (default: %(default)s)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.set_defaults(handler=run_serve)


def _fail(message: str) -> int:
    print(f"edge-agent: error: {message}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads < 1 or args.max_clients < 1:
        return _fail("--threads and --max-clients must be at least 1")
    group = args.group
    if args.dir is not None:
        store = args.dir
    else:
        from edgefl_protocol.settings import ConfigError

        from .config import load_config
        try:
            serving = load_config(args.config).serving
        except (ConfigError, ValueError, OSError) as exc:
            return _fail(f"{exc} (or name the store with --dir)")
        if not serving.dir:
            return _fail(f"{args.config}: [serving] dir is \"\": this device keeps no serving store")
        store = Path(serving.dir)
        group = serving.group if group is None else group
    path = args.socket or (Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME
                           if os.environ.get("RUNTIME_DIRECTORY") else store / SOCKET_NAME)
    try:
        server = PredictionServer(store, path, group=group or "", threads=args.threads,
                                  max_clients=args.max_clients)
        server.listen()
    except (OSError, ValueError) as exc:
        return _fail(f"cannot listen on {path}: {exc}")
    signal.signal(signal.SIGTERM, lambda *_: server.stop.set())
    signal.signal(signal.SIGINT, lambda *_: server.stop.set())
    server.serve_until_stopped()
    return 0


class BadRequest(ValueError):
    """A request the server answers with an error: `kind` is its counter."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PredictionServer:
    """The store at `store` served on the Unix socket `path`, a thread per connection, at most `max_clients`."""

    def __init__(self, store: Path, path: Path, group: str = "", threads: int = 1,
                 max_clients: int = MAX_CLIENTS) -> None:
        import torch

        from .serving import ServedModel
        torch.set_num_threads(threads)
        self.store, self.path, self.group = Path(store), Path(path), group
        self.served = ServedModel(self.store)
        self.stop = threading.Event()
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_clients)
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None

    # the socket -------------------------------------------------------------------
    def listen(self) -> None:
        if self.path.is_socket():  # left by a server that did not stop cleanly
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()
            else:
                raise ValueError("another edge-agent serve is answering there")
            finally:
                probe.close()
        elif self.path.exists():
            raise ValueError("the path exists and is not a socket")
        gid = None
        if self.group:
            try:
                gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                log.warning("group %r does not exist: only this user may connect (create it with "
                            "'sudo groupadd %s')", self.group, self.group)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born 0600: nobody else connects before the group is set
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        if gid is not None:
            os.chown(self.path, -1, gid)
        os.chmod(self.path, 0o660)
        listener.listen(64)
        listener.settimeout(POLL)
        self._listener = listener
        log.info("serving %s on %s (group %s, %d torch thread(s))", self.store, self.path,
                 self.group if gid is not None else "none", _torch_threads())

    def serve_until_stopped(self) -> None:
        assert self._listener is not None, "listen() first"
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    if self.stop.is_set():
                        break
                    log.warning("accept failed: %s", exc)
                    time.sleep(POLL)
                    continue
                if not self._slots.acquire(blocking=False):
                    self.count("busy")
                    _send(conn, {"error": "busy: this server already answers its maximum of clients; retry"})
                    conn.close()
                    continue
                thread = threading.Thread(target=self._client, args=(conn,), daemon=True)
                self._threads.add(thread)
                thread.start()
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for thread in list(self._threads):
            thread.join(timeout=2 * POLL + 1)
        try:
            if self.path.is_socket():
                self.path.unlink()
        except OSError as exc:
            log.warning("could not remove %s: %s", self.path, exc)
        log.info("stopped; answered %s", dict(sorted(self.counters.items())) or "nothing")

    def count(self, kind: str) -> None:
        with self._counter_lock:
            self.counters[kind] += 1

    def _client(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(POLL)
            for line in _lines(conn, self.stop):
                if isinstance(line, BadRequest):
                    self.count(line.kind)
                    answer: dict[str, Any] = {"error": str(line)}
                else:
                    answer = self.answer(line)
                _send(conn, answer)
        except OSError:
            pass  # the client went away
        finally:
            conn.close()
            self._slots.release()
            self._threads.discard(threading.current_thread())

    # one request ------------------------------------------------------------------
    def answer(self, line: bytes) -> dict[str, Any]:
        """The answer to one request line; never raises."""
        try:
            answer = self._answer(line)
        except BadRequest as exc:
            self.count(exc.kind)
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a server answers, it does not crash
            self.count("internal")
            log.warning("request failed: %r", exc)
            return {"error": f"internal error: {type(exc).__name__}: {exc}"}
        return answer

    def _answer(self, line: bytes) -> dict[str, Any]:
        from edgefl_models.architectures import resolve
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest("malformed", f"malformed JSON: {exc}") from None
        if not isinstance(request, dict):
            raise BadRequest("malformed", 'a request is a JSON object: {"x": [...]} or {"op": "info"}')
        op = request.get("op", "predict")
        if op not in ("predict", "info"):
            raise BadRequest("malformed", f"unknown op {op!r}: use \"info\", or send {{\"x\": [...]}}")
        model, meta = self._current()
        shape = list(resolve(meta["architecture"]).input_shape)
        if op == "info":
            self.count("info")
            with self._counter_lock:
                counters = dict(self.counters)
            return {"version": meta.get("version"), "metadata": meta, "input_shape": shape, "counters": counters}
        if "x" not in request:
            raise BadRequest("malformed", 'a prediction request names its inputs: {"x": [...]}')
        return self._predict(model, meta, shape, request["x"], request.get("probabilities") is True)

    def _current(self) -> tuple[Any, dict[str, Any]]:
        from .serving_store import CURRENT, StoreError
        try:
            return self.served.current()
        except StoreError as exc:
            if not os.path.lexists(self.store / CURRENT):
                raise BadRequest("no_model", NO_MODEL) from None
            raise BadRequest("store", str(exc)) from None

    def _predict(self, model: Any, meta: dict[str, Any], shape: list[int], x: Any,
                 probabilities: bool) -> dict[str, Any]:
        import numpy as np
        import torch
        try:
            inputs = np.asarray(x, dtype=np.float64)
        except (ValueError, TypeError):
            raise BadRequest("shape", f"x is not an array of numbers of one shape: expected a sample of shape "
                                      f"{shape} or a batch of them") from None
        if tuple(inputs.shape) == tuple(shape):
            inputs = inputs[None]
        if tuple(inputs.shape[1:]) != tuple(shape) or inputs.ndim == 0:
            raise BadRequest("shape", f"x has shape {list(inputs.shape)}: expected a sample of shape {shape} or a "
                                      f"batch [n, {', '.join(map(str, shape))}]")
        if len(inputs) > MAX_SAMPLES:
            raise BadRequest("too_large", f"{len(inputs)} samples in one request: at most {MAX_SAMPLES}; split it")
        if len(inputs) == 0:
            raise BadRequest("shape", "x holds no sample")
        if not np.isfinite(inputs).all():
            raise BadRequest("not_finite", "x holds NaN or infinity: every input must be a finite number")
        with torch.no_grad():
            output = model(torch.as_tensor(inputs, dtype=torch.float32))
        answer: dict[str, Any] = {"version": meta.get("version")}
        if meta.get("task", "classification") == "classification":
            answer["predictions"] = output.argmax(dim=1).tolist()
            if probabilities:
                answer["probabilities"] = torch.softmax(output, dim=1).tolist()
        else:
            values = output.reshape(len(inputs), -1)
            answer["predictions"] = (values[:, 0] if values.shape[1] == 1 else values).tolist()
        self.count("predictions")
        return answer


def _lines(conn: socket.socket, stop: threading.Event):  # noqa: ANN202 - yields bytes or BadRequest
    """Request lines of one connection, until it closes, stays idle past IDLE_TIMEOUT or the server stops;
    a line over MAX_LINE is skipped to its newline and yielded as a BadRequest."""
    buffer, skipping, idle_since = b"", False, time.monotonic()
    too_long = BadRequest("too_large", f"request line over {MAX_LINE // (1024 * 1024)} MB: send at most "
                                       f"{MAX_SAMPLES} samples a line, fewer when they are large")
    while not stop.is_set():
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            if time.monotonic() - idle_since > IDLE_TIMEOUT:
                return
            continue
        if not chunk:  # the client is done sending: a last line without its newline is still answered
            if buffer.strip() and not skipping:
                yield too_long if len(buffer) > MAX_LINE else buffer
            return
        idle_since = time.monotonic()
        buffer += chunk
        while True:
            end = buffer.find(b"\n")
            if skipping:
                if end < 0:
                    buffer = b""
                    break
                buffer, skipping = buffer[end + 1:], False
                yield too_long
                continue
            if end < 0:
                if len(buffer) > MAX_LINE:
                    buffer, skipping = b"", True
                break
            line, buffer = buffer[:end], buffer[end + 1:]
            if len(line) > MAX_LINE:
                yield too_long
            elif line.strip():
                yield line


def _send(conn: socket.socket, answer: dict[str, Any]) -> None:
    try:
        text = json.dumps(answer, allow_nan=False, default=_plain)
    except ValueError:  # a NaN in an answer is no JSON
        text = json.dumps({"error": "internal error: the answer holds NaN or infinity"})
    conn.sendall(text.encode() + b"\n")


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else str(value)


def _torch_threads() -> int:
    import torch
    return torch.get_num_threads()
