"""The agent's tiny HTTP server: ``/metrics``, ``/healthz``, ``/readyz`` and
``/api/v1/findings``, all rendered from state the poll loop already cached (a request never
touches NVML)."""

from __future__ import annotations

import http.server
import logging
import os
import selectors
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from forewarn.wire import Finding

__all__ = ["MetricsServer"]

log = logging.getLogger(__name__)

_findings_encoder = msgspec.json.Encoder()


class MetricsServer:
    """Threaded HTTP server: ``/metrics`` (the registry), ``/healthz`` (liveness: 200 while
    polls are fresh, else 503), ``/readyz`` (readiness: JSON ``{"ready": bool, "service":
    "agent", "components": {name: {"ready": bool, "detail": str, ...}}}``, 503 when not
    ready) and ``/api/v1/findings`` (current findings as JSON, for debugging).

    ``healthy``, ``ready`` and ``findings`` are callables so the server holds no state of
    its own.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        healthy: Callable[[], tuple[bool, str]],
        findings: Callable[[], list[Finding]],
        ready: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.registry = registry
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: " + format, *args)

        self._healthy = healthy
        self._ready = ready
        self._findings = findings
        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="forewarn-metrics",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Accept requests until :meth:`close`: blocks in select on the listening socket
        and a wake-up pipe, so an idle agent is not woken (socketserver's serve_forever
        polls twice a second; in a VM each wake-up costs a measurable share of the
        agent's CPU budget, bench/agent_poll.py)."""
        self._httpd.timeout = 0.0  # handle_request: never block on a vanished connection
        with selectors.DefaultSelector() as sel:
            sel.register(self._httpd, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = sel.select()
                if any(key.fileobj == self._wake_r for key, _ in ready):
                    return
                self._httpd.handle_request()

    def close(self) -> None:
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
            self._thread = None
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._httpd.server_close()

    def _handle(self, req: http.server.BaseHTTPRequestHandler) -> None:
        path = urllib.parse.urlsplit(req.path).path
        status = 200
        try:
            if path == "/metrics":
                encoder, ctype = choose_encoder(req.headers.get("Accept", ""))
                body = encoder(self.registry)
            elif path == "/healthz":
                ok, detail = self._healthy()
                status = 200 if ok else 503
                body, ctype = (detail + "\n").encode(), "text/plain; charset=utf-8"
            elif path == "/readyz" and self._ready is not None:
                report = self._ready()
                status = 200 if report["ready"] else 503
                body, ctype = _findings_encoder.encode(report), "application/json"
            elif path == "/api/v1/findings":
                body = _findings_encoder.encode(self._findings())
                ctype = "application/json"
            elif path == "/":
                body = b"forewarn agent: /metrics /healthz /readyz /api/v1/findings\n"
                ctype = "text/plain; charset=utf-8"
            else:
                status, body, ctype = 404, b"not found\n", "text/plain; charset=utf-8"
        except Exception as exc:  # a scrape must never take the agent down
            log.exception("error serving %s", path)
            status, body = 500, f"error: {type(exc).__name__}\n".encode()
            ctype = "text/plain; charset=utf-8"
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)
