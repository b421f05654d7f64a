"""A loopback HTTP receiver for outbound webhooks."""

from __future__ import annotations

import http.server
import threading

__all__ = ["Receiver"]


class Receiver:
    """A real HTTP server that records requests and answers with scripted statuses."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.statuses: list[int] = []
        self.hang = threading.Event()
        """While set, a request is recorded and not answered until it is cleared or
        :meth:`close` (a receiver that hangs past the sender's timeout)."""
        self._released = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.requests.append((dict(self.headers.items()), body))
                if receiver.hang.is_set():
                    receiver._released.wait(60)
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._released.set()
        self.server.shutdown()
        self.server.server_close()
