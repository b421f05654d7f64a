"""The PostgreSQL state through an outage: a unit of work fails at once while the server
is down (it does not hold the ingest writer for the pool's whole wait), the first one after
the server is back succeeds (not after the pool's reconnection backoff has grown), and a
collector started before its database opens it when the database comes up."""

from __future__ import annotations

import threading
import time

import pytest

from forewarn.collector.storage.postgres import PostgresStore
from forewarn.demo.servers import PostgresServer

from support.polling import wait_for

pytestmark = pytest.mark.system

OUTAGE_S = 20.0
"""Long enough for the pool's old reconnection backoff (1, 2, 4, 8 s ...) to pass 8 s."""

BOUND_S = 10.0
"""Far above what either takes now (about a second), far below the pool's wait (30 s) and
the backoff an outage of :data:`OUTAGE_S` grew (16 s)."""


def insert(store: PostgresStore) -> None:
    with store.write() as conn:
        conn.execute("INSERT INTO outage_probe (at) VALUES (?)", (time.time(),))


@pytest.mark.timeout(240)
def test_a_write_fails_at_once_while_postgresql_is_down_and_succeeds_once_it_is_back(
        postgres_server: PostgresServer) -> None:
    server = PostgresServer(postgres_server.bin)  # its own: this test stops it
    store = PostgresStore(server.database())
    try:
        with store.write() as conn:
            conn.execute("CREATE TABLE outage_probe (at DOUBLE PRECISION)")
        server.halt()
        failed: list[float] = []  # how long each write took to fail
        down = time.monotonic()
        while time.monotonic() - down < OUTAGE_S:  # as the ingest writer retries
            started = time.monotonic()
            with pytest.raises(store.unavailable):
                insert(store)
            failed.append(time.monotonic() - started)
            time.sleep(0.2)
        server.start()
        back = time.monotonic()
        while True:
            try:
                insert(store)
                break
            except store.unavailable:
                time.sleep(0.2)
        recovered = time.monotonic() - back
        print(f"{len(failed)} writes failed, the slowest in {max(failed):.1f} s; "
              f"the first write succeeded {recovered:.1f} s after the server was back")
        assert max(failed) < BOUND_S, f"a write waited {max(failed):.1f} s for a server down"
        assert recovered < BOUND_S, (
            f"writes succeeded only {recovered:.1f} s after the server was back")
        assert store.scalar("SELECT COUNT(*) FROM outage_probe") == 1
    finally:
        store.close()
        server.stop()


@pytest.mark.timeout(120)
def test_a_collector_started_before_its_database_opens_it_when_it_comes_up(
        postgres_server: PostgresServer) -> None:
    server = PostgresServer(postgres_server.bin)
    dsn = server.database()
    server.halt()
    opened: list[PostgresStore | BaseException] = []

    def open_store() -> None:
        try:
            opened.append(PostgresStore(dsn, connect_timeout_s=60.0))
        except BaseException as exc:  # handed to the test thread
            opened.append(exc)

    thread = threading.Thread(target=open_store)
    thread.start()
    try:
        time.sleep(3.0)  # the store is retrying meanwhile (its reconnection gives up in 1 s)
        assert not opened, opened
        server.start()
        wait_for(lambda: bool(opened), timeout=60, what="the store opened")
        store = opened[0]
        assert isinstance(store, PostgresStore), store
        assert store.schema_version > 0
        store.close()
    finally:
        thread.join(timeout=60)
        server.stop()
