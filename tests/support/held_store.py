"""A remote-write endpoint on loopback that holds each request until the test lets it
answer (tests of :class:`~forewarn.collector.storage.remote_write.RemoteWriter`)."""

from __future__ import annotations

import http.server
import threading

__all__ = ["HeldStore"]


class HeldStore:
    """A remote-write endpoint that holds each request until :meth:`release_one`; answers
    ``answers`` in turn, then 204."""

    def __init__(self, answers: tuple[int, ...] = ()) -> None:
        self.answers = list(answers)
        self.lock = threading.Lock()
        self.held: list[threading.Event] = []
        self.in_flight = self.max_in_flight = self.answered = 0
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                gate = threading.Event()
                with store.lock:
                    store.held.append(gate)
                    store.in_flight += 1
                    store.max_in_flight = max(store.max_in_flight, store.in_flight)
                gate.wait(30)
                # Out of flight before the answer leaves: the client may send its next
                # request as soon as it reads this one's, and that one's handler must not
                # find this one still counted (it would look like two at once).
                with store.lock:
                    status = store.answers.pop(0) if store.answers else 204
                    store.in_flight -= 1
                    store.answered += 1
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/api/v1/write"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def waiting(self) -> int:
        """Requests that arrived and were not let go yet (not answered, surely)."""
        with self.lock:
            return len(self.held)

    def release_one(self) -> None:
        with self.lock:
            self.held.pop(0).set()

    def close(self) -> None:
        with self.lock:
            for gate in self.held:
                gate.set()
            self.held.clear()
        self.server.shutdown()
        self.server.server_close()
