"""A loopback TCP proxy that can cut an agent off its collector (:class:`TcpProxy`): the
chaos lab's network partition."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading

__all__ = ["TcpProxy"]


class TcpProxy:
    """A loopback TCP proxy between an agent and its collector, with a cut.

    ``cut()`` models a network partition: open connections are dropped, new ones are
    accepted and then hang with no answer (as when packets are lost on the way: the agent
    sees timeouts, not a polite refusal). ``cut(refuse=True)`` resets new connections at
    once instead (the collector's host is up, its port closed). ``restore()`` lets traffic
    through again.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._cut = threading.Event()
        self._refuse = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="chaos-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self, refuse: bool = False) -> None:
        self._refuse = refuse
        self._cut.set()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self._cut.is_set():
            if self._refuse:
                # RST, not FIN: linger on with a zero timeout
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
            else:
                self._blackhole(conn)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            conn.close()
            return
        with self._lock:
            self._conns.append(upstream)
        sel = selectors.DefaultSelector()
        sel.register(conn, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, conn)
        try:
            while not self._cut.is_set():
                for key, _ in sel.select(timeout=0.2):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            for s in (conn, upstream):
                with contextlib.suppress(OSError):
                    s.close()

    def _blackhole(self, conn: socket.socket) -> None:
        """Read and discard until the cut ends or the peer gives up; never answer."""
        conn.settimeout(0.2)
        try:
            while self._cut.is_set() and not self._stop.is_set():
                try:
                    if not conn.recv(65536):
                        return
                except TimeoutError:
                    continue
        except OSError:
            return
        finally:
            conn.close()
