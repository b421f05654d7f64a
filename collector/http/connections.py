"""Connection limits for the collector's HTTP server: slowloris and descriptor exhaustion.

uvicorn accepts every connection and waits for its request head forever (its keep-alive
timer only runs after a response), and its ``limit_concurrency`` answers 503 only once a
request head is complete, so idle sockets keep their descriptors until the process runs out
(``EMFILE``: nothing is accepted any more, not even an agent's batch). :func:`guarded_protocol`
wraps uvicorn's HTTP protocol class (httptools or h11) with a :class:`ConnectionGuard`:

* **Header timeout**: a connection must send a complete request head within
  ``header_timeout_s`` of opening, or of the end of its previous response (keep-alive).
* **Body timeout**: the body must be complete within ``body_timeout_s`` of the head.
* **Head size**: more than :data:`MAX_HEAD_BYTES` without a complete head closes it.
* **Connection cap**: at ``max_connections`` open connections a new one closes the
  connection that has waited longest for a request head (an idle one: nothing in progress
  is ever cut); with none idle, the new connection gets a 503 and is closed. The cap is
  kept below the descriptor limit with room for one burst of accepts
  (:func:`connection_cap`), so ``accept`` does not fail for want of descriptors.

Metrics (on the collector's registry): ``forewarn_collector_http_connections`` (open),
``forewarn_collector_http_connections_max`` (the cap in force) and
``forewarn_collector_http_connections_closed_total{reason}`` with reasons
``header_timeout``, ``body_timeout``, ``head_too_large``, ``evicted_idle`` and
``refused_full``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = [
    "CLOSE_REASONS",
    "FD_RESERVE",
    "MAX_HEAD_BYTES",
    "ConnectionGuard",
    "connection_cap",
    "guarded_protocol",
    "protocol_class",
]

log = logging.getLogger(__name__)

FD_RESERVE = 128
"""Descriptors kept free of HTTP connections: SQLite, Parquet, staging, webhooks, drains."""
MAX_HEAD_BYTES = 64 * 1024
"""Largest request head (request line and headers) accepted."""
CLOSE_REASONS = ("header_timeout", "body_timeout", "head_too_large", "evicted_idle",
                 "refused_full")
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: 38\r\nConnection: close\r\n\r\n"
            b'{"error": "too many open connections"}')


def connection_cap(wanted: int, backlog: int = 2048) -> tuple[int, int]:
    """``(max_connections, backlog)`` that fit the open-file limit. asyncio accepts up to
    ``backlog`` connections at once before any is seen by the guard, so the cap leaves room
    for one such burst and :data:`FD_RESERVE`; with a small limit the backlog shrinks too.
    First raises the soft limit to the hard one (systemd's soft default is 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted, backlog
    headroom = max(2, soft - FD_RESERVE)
    backlog = max(1, min(backlog, headroom // 8))
    cap = max(1, min(wanted, headroom - backlog))
    if cap < wanted:
        log.warning("max_connections %d lowered to %d: the open-file limit is %d "
                    "(raise LimitNOFILE)", wanted, cap, soft)
    return cap, backlog


class ConnectionGuard:
    """Bookkeeping and timers of every open connection (runs on the event loop only)."""

    def __init__(self, *, max_connections: int, header_timeout_s: float,
                 body_timeout_s: float, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.clock = clock
        self._open: set[Any] = set()
        self._idle: collections.OrderedDict[int, Any] = collections.OrderedDict()
        """Connections waiting for a request head, longest-waiting first."""
        r = registry if registry is not None else CollectorRegistry()
        p = "forewarn_collector_http_connections"
        self.m_open = Gauge(p, "Open HTTP connections.", registry=r)
        self.m_max = Gauge(p + "_max", "Most open HTTP connections allowed.", registry=r)
        self.m_max.set(max_connections)
        self.m_closed = Counter(p + "_closed", "HTTP connections closed by the collector "
                                "before a request completed, by reason.", ["reason"],
                                registry=r)
        for reason in CLOSE_REASONS:
            self.m_closed.labels(reason)

    @property
    def open(self) -> int:
        return len(self._open)

    def opened(self, conn: Any) -> None:
        """A new connection: make room for it or refuse it, then wait for its head."""
        if len(self._open) >= self.max_connections:
            if self._idle:
                _key, oldest = self._idle.popitem(last=False)
                self._close(oldest, "evicted_idle")
            else:
                self._count("refused_full")
                conn.transport.write(_REFUSED)
                conn.transport.close()
                return
        self._open.add(conn)
        self.m_open.set(len(self._open))
        self.waiting(conn)

    def waiting(self, conn: Any) -> None:
        """``conn`` waits for a request head (new, or after a response)."""
        conn.fw_state, conn.fw_head_bytes = "head", 0
        self._idle[id(conn)] = conn
        self._idle.move_to_end(id(conn))
        self._arm(conn, self.header_timeout_s, "header_timeout")

    def head_done(self, conn: Any, more_body: bool) -> None:
        """A request head arrived; the body follows when ``more_body``."""
        self._idle.pop(id(conn), None)
        conn.fw_state = "body" if more_body else "busy"
        if more_body:
            self._arm(conn, self.body_timeout_s, "body_timeout")
        else:
            self._disarm(conn)

    def body_done(self, conn: Any) -> None:
        conn.fw_state = "busy"
        self._disarm(conn)

    def head_bytes(self, conn: Any, n: int) -> None:
        """``n`` more bytes of a request head that is not complete yet."""
        conn.fw_head_bytes += n
        if conn.fw_head_bytes > MAX_HEAD_BYTES:
            self._close(conn, "head_too_large")

    def closed(self, conn: Any) -> None:
        self._disarm(conn)
        self._idle.pop(id(conn), None)
        self._open.discard(conn)
        self.m_open.set(len(self._open))

    # -- internals ---------------------------------------------------------------------

    def _arm(self, conn: Any, seconds: float, reason: str) -> None:
        self._disarm(conn)
        conn.fw_timer = conn.loop.call_later(seconds, self._close, conn, reason)

    def _disarm(self, conn: Any) -> None:
        timer = getattr(conn, "fw_timer", None)
        if timer is not None:
            timer.cancel()
            conn.fw_timer = None

    def _close(self, conn: Any, reason: str) -> None:
        self._count(reason)
        self.closed(conn)
        conn.transport.close()

    def _count(self, reason: str) -> None:
        self.m_closed.labels(reason).inc()
        log.warning("closed an HTTP connection: %s (%d open, at most %d)", reason,
                    len(self._open), self.max_connections)


def protocol_class(http: str) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class for ``http`` (auto: httptools when installed)."""
    if http in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:
            if http == "httptools":
                raise
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def guarded_protocol(base: type[asyncio.Protocol], guard: ConnectionGuard
                     ) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's protocol ``base`` that reports to ``guard``: it relies on
    what both of uvicorn's protocols share (``cycle`` is created when a request head is
    complete, ``cycle.more_body`` is false once the body is, ``on_response_complete``)."""
    proto: Any = base

    class GuardedProtocol(proto):  # type: ignore[misc]
        fw_timer: asyncio.TimerHandle | None = None
        fw_head_bytes = 0
        fw_state = "head"
        fw_cycle: Any = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            guard.opened(self)

        def data_received(self, data: bytes) -> None:
            state = self.fw_state
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self.fw_cycle:
                self.fw_cycle = cycle
                guard.head_done(self, cycle.more_body)
            elif state == "head":
                guard.head_bytes(self, len(data))
            elif state == "body" and cycle is not None and not cycle.more_body:
                guard.body_done(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            cycle = self.cycle
            # Answered before its body was read (413, 401): the rest of the body still
            # comes under the body timer; uvicorn discards it.
            if not self.transport.is_closing() and cycle is not None and \
                    cycle.response_complete and not cycle.more_body:
                guard.waiting(self)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self)
            super().connection_lost(exc)

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedProtocol
