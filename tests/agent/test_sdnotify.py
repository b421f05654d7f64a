"""sd_notify against a real AF_UNIX datagram socket: READY, then WATCHDOG pings at half
of WATCHDOG_USEC, STOPPING at exit; abstract namespace; disabled cases."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forewarn.agent.checks.xid import XidCheck
from forewarn.agent.config import AgentConfig
from forewarn.agent.daemon import Agent
from forewarn.agent.protocols import ComponentBase, Poll
from forewarn.agent.sdnotify import Notifier
from forewarn.agent.testing import ScriptedBackend


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    yield sock, path
    sock.close()


def test_disabled_without_notify_socket() -> None:
    n = Notifier(env={})
    assert not n.enabled and n.watchdog_interval_s is None
    assert n.ready() is False and n.watchdog() is False and n.stopping() is False


def test_watchdog_interval_rules() -> None:
    assert Notifier(env={"WATCHDOG_USEC": "30000000"}).watchdog_interval_s == 15.0
    pid = os.getpid()
    assert Notifier(env={"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(pid)}
                    ).watchdog_interval_s == 2.0
    # Meant for another process (e.g. the parent): not ours to ping.
    assert Notifier(env={"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(pid + 1)}
                    ).watchdog_interval_s is None
    assert Notifier(env={"WATCHDOG_USEC": "0"}).watchdog_interval_s is None
    assert Notifier(env={"WATCHDOG_USEC": "junk"}).watchdog_interval_s is None


def test_messages_reach_a_path_socket(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    n = Notifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    assert n.ready("3 GPUs") and n.watchdog() and n.status("line one\nline two")
    assert n.stopping()
    got = [sock.recv(4096).decode() for _ in range(4)]
    assert got == ["READY=1\nSTATUS=3 GPUs", "WATCHDOG=1", "STATUS=line one", "STOPPING=1"]
    n.close()


def test_abstract_namespace_socket() -> None:
    name = f"forewarn-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        n = Notifier(env={"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_send_failure_is_counted_not_raised(tmp_path: Path) -> None:
    n = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert n.ready() is False and n.watchdog() is False
    assert n.failures == 1


def test_agent_sends_ready_after_first_poll_then_pings_at_half_watchdog(
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    polls: list[float] = []

    class Counter(ComponentBase):
        name = "counter"

        def on_poll(self, poll: Poll) -> None:
            polls.append(time.monotonic())

    # Poll rarely (2 s) with a 0.4 s watchdog: pings must come from the wait, every 0.2 s.
    config = AgentConfig(node="n", listen="127.0.0.1:0", kmsg=False, interval_s=2.0)
    agent = Agent(config, ScriptedBackend(lambda i, t: {"temperature_c": 40.0}),
                  checks=[XidCheck()],
                  notifier=Notifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}))
    agent.add_component(Counter())
    agent.start()
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,))
    thread.start()
    try:
        ready = sock.recv(4096).decode()
        ready_at = time.monotonic()
        assert ready.startswith("READY=1\nSTATUS=2 GPU(s) via scripted")
        assert polls and polls[0] <= ready_at, "READY before the first poll"
        assert agent.address is not None, "READY before /metrics is up"
        stamps: list[float] = []
        while len(stamps) < 6:
            msg = sock.recv(4096).decode()
            if msg == "WATCHDOG=1":
                stamps.append(time.monotonic())
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        mean = sum(gaps) / len(gaps)
        # Half of 0.4 s; generous bounds for a shared machine, but well below the
        # 2 s poll interval and above zero (not a busy loop).
        assert 0.1 <= mean <= 0.4, gaps
        assert len(polls) <= 2
    finally:
        stop.set()
        thread.join(timeout=5)
        agent.stop()
    rest = []
    sock.settimeout(1)
    try:
        while True:
            rest.append(sock.recv(4096).decode())
    except TimeoutError:
        pass
    assert rest and rest[-1] == "STOPPING=1"
