"""Fixtures of the collector tests that several files share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.storage.state import StateStore, open_state
from forewarn.demo.servers import PostgresServer

from support.bus_stack import auth_block
from support.handover import Service
from support.nats_server import NatsServer, start_server


@pytest.fixture
def bus_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server with JetStream and the nodes' and collector's users of
    :mod:`support.bus_stack`."""
    server = start_server(tmp_path / "nats", authorization=auth_block())
    yield server
    server.stop()


@pytest.fixture
def services(postgres_server: PostgresServer) -> Iterator[tuple[str, list[Service]]]:
    """An empty PostgreSQL database and a list the test adds the collector services it
    starts on it to (:class:`support.handover.Service`); they are stopped afterwards."""
    started: list[Service] = []
    try:
        yield postgres_server.database(), started
    finally:
        for s in started:
            s.stop()


@pytest.fixture
def sqlite_state(tmp_path: Path) -> Iterator[StateStore]:
    """An embedded (SQLite) state store in ``tmp_path/data``."""
    state = open_state(CollectorConfig(data_dir=tmp_path / "data",
                                       tokens_file=tmp_path / "none.toml"))
    yield state
    state.close()


@pytest.fixture
def backend_state(tmp_path: Path, state_backend: dict[str, Any]) -> Iterator[StateStore]:
    """A state store on each backend in turn (SQLite, then PostgreSQL: ``state_backend``)."""
    state = open_state(CollectorConfig(data_dir=tmp_path / "data",
                                       tokens_file=tmp_path / "none.toml", **state_backend))
    yield state
    state.close()
