"""Scale-out: replicas share the ``telemetry_files`` bookkeeping on PostgreSQL, but each
keeps the Parquet files it wrote in its own data_dir. Every replica's scrub, compaction,
prune, read and recovery acts on its own files only (the chaos scale-out run saw a
restarted replica log "recorded but missing" for another replica's file)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.datadir import DataDirError, replica_id
from forewarn.collector.storage.postgres import PostgresStore
from forewarn.collector.storage.state import open_state
from forewarn.collector.storage.store import Store
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.demo.servers import PostgresServer
from forewarn.wire import AgentBatch, GpuSample, encode

DAY = 86400.0
YESTERDAY = (time.time() // DAY - 1) * DAY + 3600.0
"""A time on a day that is over (so compaction takes it) and inside retention."""


def stage(store: PostgresStore | Store, agent_id: str, seq: int, at: float,
          gpus: int = 2) -> None:
    samples = [GpuSample(node="n1", gpu=g, time=at, source="sim", simulated=True,
                         temperature_c=50.0) for g in range(gpus)]
    body = encode(AgentBatch(node="n1", agent_id=agent_id, seq=seq, created=at,
                             samples=samples))
    with store.write() as conn:
        conn.execute("INSERT INTO staged_samples (agent_id, seq, samples, body)"
                     " VALUES (?, ?, ?, ?)", (agent_id, seq, len(samples), body))


@pytest.fixture
def shared(postgres_server: PostgresServer) -> Iterator[PostgresStore]:
    store = PostgresStore(postgres_server.database())
    yield store
    store.close()


def writer(store: PostgresStore | Store, data_dir: Path) -> TelemetryWriter:
    """A replica's telemetry writer, as the app builds it on shared state."""
    return TelemetryWriter(store, data_dir / "telemetry", CollectorMetrics(),
                           replica=replica_id(data_dir))


def two_flushed(store: PostgresStore, tmp_path: Path, at: float
                ) -> tuple[TelemetryWriter, TelemetryWriter]:
    """Replica A leads and flushes two files of ``at``'s day, then B leads and does too."""
    a, b = writer(store, tmp_path / "a"), writer(store, tmp_path / "b")
    for seq, w in ((1, a), (2, a), (3, b), (4, b)):
        stage(store, "agent", seq, at)
        assert w.flush() == 2
    return a, b


def recorded(store: PostgresStore) -> list[str]:
    return sorted(r["name"] for r in store.query("SELECT name FROM telemetry_files"))


def test_a_replica_id_is_kept_in_its_data_dir(tmp_path: Path) -> None:
    first = replica_id(tmp_path / "a")
    assert first == replica_id(tmp_path / "a"), "a restart must keep the replica's id"
    assert first != replica_id(tmp_path / "b")


@pytest.mark.parametrize("body", [b"", b"\n", b"\xff\xfe\x00junk\n", b"two words\n",
                                  b"a" * 65 + b"\n"])
def test_a_damaged_replica_id_stops_the_start_naming_the_file(
        tmp_path: Path, body: bytes) -> None:
    # An empty id is embedded state's name for every file: a replica taking it would act on
    # every file recorded before replicas were named, whoever's data_dir holds them.
    (tmp_path / "replica-id").write_bytes(body)
    with pytest.raises(DataDirError, match="replica-id"):
        replica_id(tmp_path)


@pytest.mark.system
def test_a_scrub_reports_no_other_replicas_file_missing(
        tmp_path: Path, shared: PostgresStore, caplog: pytest.LogCaptureFixture) -> None:
    a, b = two_flushed(shared, tmp_path, time.time() - 5)
    with caplog.at_level(logging.ERROR):
        assert a.scrub() == [] and b.scrub() == []
    assert "missing" not in caplog.text
    assert a.metrics.missing_files._value.get() == 0
    # A file of its own that is gone is still reported.
    (a.root / recorded(shared)[0]).unlink()
    a.scrub()
    assert a.metrics.missing_files._value.get() == 1


@pytest.mark.system
def test_a_compaction_never_drops_another_replicas_rows(
        tmp_path: Path, shared: PostgresStore) -> None:
    a, b = two_flushed(shared, tmp_path, YESTERDAY)
    day = recorded(shared)[0].removeprefix("date=")[:10]
    assert a.compact_old_days() == {day: 2}
    assert len(recorded(shared)) == 3, "A merges its own two files, B's two stay recorded"
    assert b.compact_old_days() == {day: 2}
    assert len(recorded(shared)) == 2
    assert len(a.read(include_staged=False)) == 4
    assert len(b.read(include_staged=False)) == 4
    assert not list(tmp_path.glob("*/quarantine/**/*.parquet"))


@pytest.mark.system
def test_prune_removes_only_its_own_rows(tmp_path: Path, shared: PostgresStore) -> None:
    old = time.time() - 40 * DAY
    a, b = two_flushed(shared, tmp_path, old)
    assert len(recorded(shared)) == 4
    assert a.prune() != []
    assert len(recorded(shared)) == 2, "B's files of that day are still on B's disk"
    assert len(b.read(include_staged=False)) == 4
    b.prune()
    assert recorded(shared) == []


@pytest.mark.system
def test_read_returns_its_own_rows_and_says_what_lives_elsewhere(
        tmp_path: Path, shared: PostgresStore, caplog: pytest.LogCaptureFixture) -> None:
    a, _b = two_flushed(shared, tmp_path, time.time() - 5)
    with caplog.at_level(logging.WARNING):
        df = a.read(include_staged=False)
    assert sorted(df["seq"].unique()) == [1, 2]
    assert a.metrics.read_errors._value.get() == 0, "another replica's file is no read error"
    assert "2 files (4 rows) recorded by other replicas" in caplog.text


@pytest.mark.system
def test_recovery_leaves_another_replicas_files_alone(
        tmp_path: Path, shared: PostgresStore) -> None:
    _a, b = two_flushed(shared, tmp_path, time.time() - 5)
    names = recorded(shared)
    got = writer(shared, tmp_path / "a").recover()
    assert got.removed == [] and got.quarantined == []
    assert recorded(shared) == names
    assert len(b.read(include_staged=False)) == 4


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[TelemetryWriter]:
    """Embedded state's writer, with two files of yesterday recorded."""
    store = Store(tmp_path / "collector.db")
    w = TelemetryWriter(store, tmp_path / "telemetry", CollectorMetrics())
    for seq in (1, 2):
        stage(store, "agent", seq, YESTERDAY)
        assert w.flush() == 2
    yield w
    store.close()


def test_embedded_state_keeps_every_recorded_file_its_own(embedded: TelemetryWriter
                                                          ) -> None:
    """SQLite (one replica, the database inside its data_dir): unchanged."""
    w = embedded
    assert w.compact_old_days() != {}
    assert len(w.read(include_staged=False)) == 4
    (w.root / w.store.query("SELECT name FROM telemetry_files")[0]["name"]).unlink()
    w.scrub()
    assert w.metrics.missing_files._value.get() == 1


@pytest.mark.system
def test_rows_recorded_before_replicas_were_named_go_to_the_replica_holding_the_file(
        tmp_path: Path, shared: PostgresStore) -> None:
    a, b = two_flushed(shared, tmp_path, time.time() - 5)
    with shared.write() as conn:  # as migration 0008 leaves rows recorded before it
        conn.execute("UPDATE telemetry_files SET replica = ''")
    writer(shared, tmp_path / "b").recover()
    writer(shared, tmp_path / "a").recover()
    owners = {r["name"]: r["replica"] for r in shared.query(
        "SELECT name, replica FROM telemetry_files")}
    assert sorted(owners.values()) == sorted([a.replica] * 2 + [b.replica] * 2)
    assert len(a.read(include_staged=False)) == 4


@pytest.mark.parametrize("state", ["sqlite", "postgresql"])
def test_the_app_records_its_files_under_its_data_dirs_replica_id(
        tmp_path: Path, state: str, request: pytest.FixtureRequest) -> None:
    extra: dict[str, Any] = {}
    if state == "postgresql":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        extra = {"state": state, "postgres_dsn": server.database()}
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                          tokens_file=tmp_path / "none.toml", **extra)
    store = open_state(cfg)
    try:
        app = create_app(cfg, store, tokens=TokenRegistry(tokens={}))
        want = replica_id(cfg.data_dir) if state == "postgresql" else ""
        assert app.state.ctx.telemetry.replica == want
    finally:
        store.close()


def test_a_compaction_missing_a_file_of_its_own_keeps_its_record_and_fails_nothing(
        embedded: TelemetryWriter, caplog: pytest.LogCaptureFixture) -> None:
    """Like the scrub: an unmounted disk comes back. Before, moving the missing file to
    the quarantine raised, and so did every retention pass after it."""
    w = embedded
    gone = w.store.query("SELECT name FROM telemetry_files ORDER BY name")[0]["name"]
    (w.root / gone).unlink()
    with caplog.at_level(logging.ERROR):
        assert list(w.compact_old_days().values()) == [0]
    assert f"{gone} is recorded but missing" in caplog.text
    assert len(w.store.query("SELECT name FROM telemetry_files")) == 2
