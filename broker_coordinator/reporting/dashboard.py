"""The coordinator's read-only page: the fleet and the rounds, on the metrics port (`[metrics] port`).

    /            the page (dashboard_page.PAGE: one HTML file, no external assets)
    /fleet.json  what the page shows, read from the state directory at each request
    /metrics     Prometheus' exposition, as before

What /fleet.json holds is the caller's (`broker-coordinator run` and `simulate`: engine/fleet_view.py
reads what `status` reads, through a connection of its own, so a request never waits on a round). Like the metrics it
listens on loopback unless `[metrics] bind` says otherwise; docs/OPERATOR.md says how to put it
behind a reverse proxy with authentication.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .dashboard_page import PAGE

log = logging.getLogger("broker_coordinator")


class MetricsServer:
    """/metrics always; / and /fleet.json when `snapshot` is given (a coordinator with a state directory)."""

    def __init__(self, registry: CollectorRegistry, port: int, bind: str,
                 snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.answer(self)

            def log_message(self, *args: Any) -> None:  # requests are not the operator's news
                pass

        self.registry, self.snapshot = registry, snapshot
        self.http = ThreadingHTTPServer((bind, port), Handler)
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(request, 200, CONTENT_TYPE_LATEST, generate_latest(self.registry))
        elif path in ("/", "/index.html") and self.snapshot is not None:
            self._send(request, 200, "text/html; charset=utf-8", PAGE.encode())
        elif path == "/fleet.json" and self.snapshot is not None:
            try:
                body = json.dumps(self.snapshot()).encode()
            except Exception as exc:  # noqa: BLE001 - the page says what went wrong; the coordinator goes on
                log.info("dashboard: cannot read the state directory: %s", exc)
                self._send(request, 503, "application/json", json.dumps({"error": str(exc)}).encode())
                return
            self._send(request, 200, "application/json", body)
        else:
            self._send(request, 404, "text/plain; charset=utf-8", b"not found: / (the page), /fleet.json, /metrics\n")

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, kind: str, body: bytes) -> None:
        request.send_response(status)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        request.end_headers()
        request.wfile.write(body)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
