"""forewarn's daemons as child processes: start, kill -9, stop and restart them, and wait
until they answer (the demo, the chaos lab and the tests).

Everything started here is recorded in a :class:`Procs` so that one ``close()`` (also on
Ctrl-C) ends every process group it started, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forewarn.spawn.interrupts import interrupts_held

__all__ = ["Procs", "get_json", "leader_role", "log_tail", "one_leader", "readyz",
           "stop_process", "wait_http", "wait_ready", "wait_until"]


def get_json(url: str, timeout: float = 2.0) -> Any:
    """GET ``url`` and decode its JSON body."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def readyz(url: str, timeout: float = 1.0) -> tuple[int, dict[str, Any]]:
    """A collector's ``/readyz`` status and report, also when it answers 503 (not
    ready: the report says which component)."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def leader_role(url: str) -> str:
    """A collector replica's role (``leader``, ``follower``) from ``/readyz``."""
    return str(readyz(url)[1]["components"]["leader"]["role"])


def one_leader(urls: dict[str, str], timeout: float = 30.0) -> dict[str, str] | None:
    """Replica name -> role (:func:`leader_role`) once exactly one of the replicas at
    ``urls`` leads and the others follow; None when that does not happen in ``timeout``."""
    def roles() -> dict[str, str] | None:
        got = {name: leader_role(url) for name, url in urls.items()}
        return got if sorted(got.values()) == ["follower"] * (len(got) - 1) + ["leader"] \
            else None

    found: dict[str, str] | None = wait_until(roles, timeout)
    return found


def wait_until(cond: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    """Poll ``cond`` until it returns something truthy (returned) or ``timeout`` passes
    (None). Exceptions from ``cond`` count as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except Exception:
            got = None
        if got:
            return got
        if time.monotonic() >= deadline:
            return None
        time.sleep(step)


def log_tail(log: Path, n: int = 2000) -> str:
    """The last ``n`` characters of ``log`` ("" when it cannot be read)."""
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-n:]
    return ""


def wait_ready(ready: Callable[[], Any], timeout: float, proc: subprocess.Popen[bytes] | None,
               log: Path, what: str) -> None:
    """Wait until ``ready()`` returns something truthy (an ``OSError`` is "not yet"); fail
    early, with the log's tail, if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} did not start (exit {proc.returncode}); log {log}:\n"
                               f"{log_tail(log)}")
        with contextlib.suppress(OSError):
            if ready():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer within {timeout:.0f} s; log {log}:\n"
                       f"{log_tail(log)}")


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None, log: Path
              ) -> None:
    """Wait until ``url`` answers with a success status (:func:`wait_ready`)."""
    def answers() -> bool:
        urllib.request.urlopen(url, timeout=1).close()
        return True

    wait_ready(answers, timeout, proc, log, url)


def stop_process(p: subprocess.Popen[bytes], timeout: float = 30.0, *, group: bool = True
                 ) -> int | None:
    """SIGTERM ``p`` (with ``group``: the process group it leads, as :class:`Procs` starts
    them) and wait; SIGKILL after ``timeout``. Its exit code."""
    if p.poll() is None:
        _send(p, signal.SIGTERM, group)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _send(p, signal.SIGKILL, group)
            p.wait(timeout=5)
    return p.returncode


def _send(p: subprocess.Popen[bytes], sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)


class Procs:
    """Named daemon processes, each in its own process group."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._all: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str], log: Path,
              env: dict[str, str] | None = None, cwd: Path | None = None
              ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (no shell) with stdout and stderr appended to ``log``. A Ctrl-C
        meanwhile waits until the process is recorded (``close()`` then ends it)."""
        with log.open("ab") as out, interrupts_held():
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                 start_new_session=True)
            self.procs[name] = p
            self._all.append(p)
        return p

    def start(self, name: str, argv: list[str], log: Path, health_url: str,
              timeout: float = 60.0, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        """:meth:`spawn`, then wait until ``health_url`` answers (:func:`wait_http`)."""
        proc = self.spawn(name, argv, log, env)
        wait_http(health_url, timeout, proc, log)
        return proc

    def kill9(self, name: str) -> float:
        """``kill -9`` the process group of ``name``; returns the time of the kill."""
        p = self.procs[name]
        t = time.time()
        _send(p, signal.SIGKILL, group=True)
        p.wait(timeout=10)
        return t

    def stop(self, name: str, timeout: float = 30.0) -> int | None:
        """SIGTERM ``name`` and wait (SIGKILL after ``timeout``); returns its exit code."""
        return stop_process(self.procs[name], timeout)

    def close(self) -> None:
        """End everything started here: SIGTERM, then SIGKILL after 10 s."""
        live = [p for p in self._all if p.poll() is None]
        for p in live:
            _send(p, signal.SIGTERM, group=True)
        deadline = time.monotonic() + 10
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _send(p, signal.SIGKILL, group=True)
                p.wait(timeout=5)
