"""Real nats-server processes for tests: one JetStream server, or a cluster on loopback
(:mod:`forewarn.demo.servers`, which ``forewarn demo --scale-out`` uses too).

:func:`start_server` writes a config file (JetStream store under the test's folder, an
optional ``authorization`` block, optional cluster routes) and waits for the client port.
:class:`NatsServer` can be stopped (SIGTERM), killed (SIGKILL) and started again on the
same port and store, which is how tests take NATS away and give it back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from forewarn.demo import servers
from forewarn.demo.servers import MissingServer, NatsServer

__all__ = ["NatsServer", "nats_binary", "start_cluster", "start_server"]


def nats_binary() -> str:
    """The nats-server binary; skips when missing, fails under CI."""
    try:
        return servers.find_binary("nats-server")
    except MissingServer as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc}; .ci/run must install it")
        pytest.skip(str(exc))


def start_server(root: Path, *, authorization: str = "", name: str = "nats",
                 extra: str = "") -> NatsServer:
    """One JetStream server on a free loopback port, store under ``root``; ``extra``:
    more config lines."""
    return servers.start_nats(root, authorization=authorization, name=name, extra=extra,
                              binary=nats_binary())


@contextlib.contextmanager
def start_cluster(root: Path, size: int = 3, *, authorization: str = ""
                  ) -> Iterator[list[NatsServer]]:
    """A ``size``-node JetStream cluster on loopback; every server stopped at the end."""
    with servers.start_nats_cluster(root, size, authorization=authorization,
                                    binary=nats_binary()) as cluster:
        yield cluster
