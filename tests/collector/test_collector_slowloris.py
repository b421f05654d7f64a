"""Slowloris against a real ``forewarn collector run`` process on loopback.

The collector runs with the descriptor limit systemd gives a service by default (1,024).
An attacker thread holds 1,100 sockets open (half silent, half dripping a request head a
byte at a time, reopening what the collector closes) for a bounded time; meanwhile a real
``forewarn agent`` must get its batches stored within seconds, idle sockets must be closed
by the header and body timeouts, and the collector's log must stay small."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forewarn.collector.http.auth import enroll
from forewarn.spawn.commands import agent_command, collector_command

from support.paths import REPO
from support.polling import START_TIMEOUT_S, free_port, poll, wait_for

NOFILE = 1024
ATTACK_SOCKETS = 1100


def _limit_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@contextlib.contextmanager
def collector(tmp_path: Path, **keys: str) -> Iterator[tuple[str, Path, Path]]:
    """A ``forewarn collector run`` limited to 1,024 descriptors: (url, log, token file)."""
    port = free_port()
    tokens = tmp_path / "tokens.toml"
    token_file = tmp_path / "node.token"
    enroll(tokens, "n1", token_file)
    config = tmp_path / "collector.toml"
    config.write_text(
        f'listen = "127.0.0.1:{port}"\ndata_dir = "{tmp_path / "data"}"\n'
        f'tokens_file = "{tokens}"\n' + "".join(f"{k} = {v}\n" for k, v in keys.items()))
    log = tmp_path / "collector.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            collector_command(config),
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit_nofile,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, START_TIMEOUT_S, "collector start")
        yield url, log, token_file
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Slowloris:
    """Hold ``n`` sockets to ``port`` for ``seconds`` (a bounded loop that ends by itself):
    even ones send nothing, odd ones drip a request head one byte per second; a socket
    the server closed is opened again."""

    HEAD = b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nX-Slow: "

    def __init__(self, port: int, n: int, seconds: float) -> None:
        self.port, self.n, self.seconds = port, n, seconds
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Slowloris:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _open(self) -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", self.port), timeout=2)
        except OSError:
            return None

    def _run(self) -> None:
        socks: list[socket.socket | None] = [self._open() for _ in range(self.n)]
        sent = [0] * self.n
        end = time.monotonic() + self.seconds
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                for i, s in enumerate(socks):
                    if s is None or (i % 2 and not self._drip(s, sent[i])):
                        if s is not None:
                            s.close()
                        socks[i], sent[i] = self._open(), 0
                        self.reopened += 1
                    elif i % 2:
                        sent[i] += 1
                self._stop.wait(1.0)
        finally:
            for s in socks:
                if s is not None:
                    s.close()

    def _drip(self, s: socket.socket, sent: int) -> bool:
        """Send the next byte of the head; False when the server closed the socket."""
        try:
            s.send(self.HEAD[sent:sent + 1] if sent < len(self.HEAD) else b"a")
            s.setblocking(False)
            try:
                return s.recv(1) != b""
            except BlockingIOError:
                return True
            finally:
                s.setblocking(True)
        except OSError:
            return False


def stored_batches(data: Path, node: str) -> int:
    db = data / "collector.db"
    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as c:
        try:
            return int(c.execute("SELECT count(*) FROM batches WHERE node = ?",
                                 (node,)).fetchone()[0])
        except sqlite3.OperationalError:
            return 0


@pytest.mark.timeout(300)
def test_agent_batch_is_stored_while_1100_idle_sockets_are_open(tmp_path: Path) -> None:
    with collector(tmp_path) as (url, log, token_file):
        port = int(url.rsplit(":", 1)[1])
        with Slowloris(port, ATTACK_SOCKETS, seconds=40):
            time.sleep(3)  # the attack is in place before the agent starts
            lines_before_agent = len(log.read_text().splitlines())
            agent_log = (tmp_path / "agent.log").open("wb")
            agent = subprocess.Popen(
                agent_command("n1", socket=tmp_path / "agent.sock", collector=url,
                              token_file=token_file),
                stdout=agent_log, stderr=subprocess.STDOUT,
                env={**os.environ, "FOREWARN_AGENT_SPOOL_DIR": str(tmp_path / "spool"),
                     "FOREWARN_AGENT_PUSH_INTERVAL_S": "0.5", "FOREWARN_AGENT_WATCHDOG": "0"})
            try:
                # The agent needs 2-10 s to start (machine load); then batches land in seconds.
                stored = poll(lambda: stored_batches(tmp_path / "data", "n1") >= 3, 30, 0.2)
                assert stored, ("no agent batch stored under the attack\n"
                                + log.read_text()[-3000:])
            finally:
                agent.terminate()
                agent.wait(30)
                agent_log.close()
            # The collector's own clients still get answers during the attack.
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
        closed = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^forewarn_collector_http_connections_closed_total\{reason="(\w+)"\} (\S+)$',
            metrics, re.M)}
        assert closed.get("header_timeout", 0) + closed.get("evicted_idle", 0) > 0, closed
        cap = float(re.search(r"^forewarn_collector_http_connections_max (\S+)$", metrics,
                              re.M).group(1))  # type: ignore[union-attr]
        assert 0 < cap < NOFILE
        lines = log.read_text().splitlines()
        # one line per kind per interval with a count, not one line (or a traceback) each
        assert len(lines) - lines_before_agent < 60, "\n".join(lines[-80:])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_header_and_body_timeouts_close_stalled_requests(tmp_path: Path, parser: str) -> None:
    with collector(tmp_path, header_timeout_s="1.0", body_timeout_s="2.0",
                   http=f'"{parser}"') as (url, _log, _t):
        port = int(url.rsplit(":", 1)[1])
        silent = socket.create_connection(("127.0.0.1", port))
        partial_head = socket.create_connection(("127.0.0.1", port))
        partial_head.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        partial_body = socket.create_connection(("127.0.0.1", port))
        partial_body.sendall(b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/msgpack\r\n"
                             b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
        t0 = time.monotonic()
        for s in (silent, partial_head, partial_body):
            s.settimeout(15)
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(4096):
                    data += chunk
            s.close()
            assert b"200 OK" not in data
        # all three were closed by the server, the last by the 2 s body timeout
        assert time.monotonic() - t0 < 10
        # normal requests are unaffected, several on one kept-alive connection too
        with httpx.Client(base_url=url, timeout=5) as client:
            for _ in range(3):
                assert client.get("/healthz").status_code == 200
                time.sleep(0.5)


def test_collector_unit_gives_room_for_max_connections() -> None:
    """The unit's LimitNOFILE leaves the default max_connections its descriptors (else the
    collector lowers the cap to fit systemd's default of 1,024)."""
    from forewarn.collector.config import CollectorConfig
    from forewarn.collector.http.connections import FD_RESERVE

    unit = REPO / "deploy" / "forewarn-collector.service"
    limits = re.findall(r"^LimitNOFILE=(\d+)$", unit.read_text(), re.M)
    assert limits, "LimitNOFILE= missing from the collector unit"
    assert int(limits[0]) >= CollectorConfig().max_connections + FD_RESERVE + 2048
