"""Real nats-server processes for tests: one JetStream server, or a cluster on loopback.

:func:`start_server` writes a config file (JetStream store under the test's folder, an
optional ``authorization`` block, optional cluster routes) and waits for the client port.
:class:`NatsServer` can be stopped (SIGTERM), killed (SIGKILL) and started again on the
same port and store, which is how tests take NATS away and give it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.polling import free_port

__all__ = ["NatsServer", "nats_binary", "start_cluster", "start_server"]


def nats_binary() -> str:
    """The nats-server binary (``/usr/sbin`` is not on every PATH); skips when missing,
    fails under CI."""
    path = shutil.which("nats-server") or next(
        (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if os.path.exists(p)),
        None)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail("nats-server is not installed; .ci/run must install it")
    pytest.skip("nats-server is not installed")


@dataclasses.dataclass
class NatsServer:
    """One nats-server process with a fixed port and store (restartable)."""

    name: str
    root: Path
    port: int
    config: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, *, wait_s: float = 20.0) -> NatsServer:
        conf = self.root / f"{self.name}.conf"
        conf.write_text(self.config)
        log = (self.root / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen([nats_binary(), "-c", str(conf)], stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server {self.name} exited: {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"nats-server {self.name} did not listen: {self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / f"{self.name}.log").read_text()[-2000:]
        return ""


def _config(name: str, root: Path, port: int, authorization: str = "",
            cluster: str = "", extra: str = "") -> str:
    store = root / f"{name}-js"
    return (f'server_name: "{name}"\nlisten: "127.0.0.1:{port}"\n'
            f'jetstream {{ store_dir: "{store}" }}\n{cluster}{authorization}{extra}')


def start_server(root: Path, *, authorization: str = "", name: str = "nats",
                 extra: str = "") -> NatsServer:
    """One JetStream server on a free loopback port, store under ``root``; ``extra``:
    more config lines."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    return NatsServer(name, root, port,
                      _config(name, root, port, authorization, extra=extra)).start()


@contextlib.contextmanager
def start_cluster(root: Path, size: int = 3, *, authorization: str = ""
                  ) -> Iterator[list[NatsServer]]:
    """A ``size``-node JetStream cluster on loopback; every server stopped at the end."""
    root.mkdir(parents=True, exist_ok=True)
    ports = [(free_port(), free_port()) for _ in range(size)]
    servers = []
    for i, (port, cport) in enumerate(ports):
        routes = ", ".join(f'"nats://127.0.0.1:{c}"' for j, (_p, c) in enumerate(ports)
                           if j != i)
        cluster = (f'cluster {{ name: "fw"\n listen: "127.0.0.1:{cport}"\n'
                   f' routes: [{routes}] }}\n')
        servers.append(NatsServer(f"n{i}", root, port,
                                  _config(f"n{i}", root, port, authorization, cluster)))
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.stop()
