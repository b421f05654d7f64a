"""Store migrations and the Parquet telemetry path: staging, flush, crash recovery, retention."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from forewarn.collector.config import CollectorConfig
from forewarn.collector.ingest.batch import IngestResult, IngestWriter
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.parquet_layout import COLUMNS
from forewarn.collector.storage.staging import StagingLog
from forewarn.collector.storage.state import StateStore, open_state
from forewarn.collector.storage.store import MIGRATIONS, Store, StoreError
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.wire import AgentBatch, GpuSample, NvlinkCounters

DAY = 86400.0
T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


def batch(seq: int, t: float, n: int = 3, node: str = "n1") -> AgentBatch:
    links = (NvlinkCounters(link=0, crc_flit=2, replay=None),
             NvlinkCounters(link=1, crc_flit=3, replay=None))
    return AgentBatch(node=node, agent_id="a1", seq=seq, created=t, samples=[
        GpuSample(node=node, gpu=g, time=t, source="sim", temperature_c=40.0 + g,
                  nvlink=links, unsupported=("pstate", "power_w")) for g in range(n)])


def ingest(store: StateStore, tel: TelemetryWriter, *batches: AgentBatch) -> list[IngestResult]:
    writer = IngestWriter(store, tel.metrics, on_staged=tel.remember, staging=tel.staging)
    writer.start()
    try:
        futures = [writer.submit(b, _encode(b)) for b in batches]
        return [f.result(10) for f in futures]
    finally:
        writer.stop()


def _encode(b: AgentBatch) -> bytes:
    from forewarn.wire import encode

    return encode(b)


@pytest.fixture
def parts(tmp_path: Path, state_backend: dict[str, Any]
          ) -> Iterator[tuple[StateStore, TelemetryWriter]]:
    """The state store (SQLite, then PostgreSQL: the tests using this run on both) and a
    telemetry writer without a staging log (bodies in the staged rows)."""
    store = open_state(CollectorConfig(data_dir=tmp_path, **state_backend))
    yield store, TelemetryWriter(store, tmp_path / "telemetry", CollectorMetrics(),
                                  retention_days=7, clock=lambda: T0 + 10 * DAY)
    store.close()


def test_migrations_set_user_version_and_refuse_a_newer_schema(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    assert store.schema_version == len(MIGRATIONS)
    assert store.scalar("PRAGMA journal_mode") == "wal"
    store.close()
    Store(tmp_path / "c.db").close()  # reopening runs nothing twice
    conn = sqlite3.connect(tmp_path / "c.db")
    conn.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this forewarn"):
        Store(tmp_path / "c.db")


def test_an_upgrade_migrates_an_older_database_and_keeps_its_rows(tmp_path: Path) -> None:
    """docs/storage.md, "Upgrading and going back": a database of forewarn before the
    scorer state (schema 5) is migrated at start, a recorded file kept under no replica."""
    conn = sqlite3.connect(tmp_path / "c.db")
    for statement in (s for migration in MIGRATIONS[:5] for s in migration):
        conn.execute(statement)
    conn.execute("INSERT INTO telemetry_files (name, day, first_id, last_id, rows, created)"
                 " VALUES ('date=2023-11-14/a.parquet', '2023-11-14', 1, 2, 3, 0)")
    conn.execute("PRAGMA user_version=5")
    conn.commit()
    conn.close()
    store = Store(tmp_path / "c.db")
    assert store.schema_version == len(MIGRATIONS)
    assert store.scalar("SELECT replica || '/' || rows FROM telemetry_files") == "/3"
    assert store.scalar("SELECT count(*) FROM scorer_state") == 0
    store.close()


def test_flush_writes_daily_parquet_once_with_the_replay_columns(
        parts: tuple[StateStore, TelemetryWriter]) -> None:
    store, tel = parts
    results = ingest(store, tel, batch(0, T0), batch(1, T0 + DAY), batch(1, T0 + DAY),
                     batch(2, T0 + DAY + 5))
    assert results == [IngestResult.STORED, IngestResult.STORED, IngestResult.DUPLICATE,
                       IngestResult.STORED]
    assert tel.staged_samples() == 9
    assert tel.flush() == 9
    assert tel.staged_samples() == 0 and tel.flush() == 0
    days = sorted(p.name for p in tel.root.iterdir())
    assert days == ["date=2023-11-14", "date=2023-11-15"]
    table = pq.read_table(next((tel.root / "date=2023-11-15").glob("*.parquet")))
    assert table.column_names == [name for name, _ in COLUMNS]
    assert table.num_rows == 6
    df = tel.read()
    assert len(df) == 9 and sorted(set(df["seq"])) == [0, 1, 2]
    assert set(df["nvlink_crc_flit"]) == {5} and df["nvlink_replay"].isna().all()
    assert set(df["unsupported"]) == {"pstate,power_w"}
    assert len(tel.read(start=T0 + DAY, node="n1")) == 6


def test_flush_without_the_in_memory_copy_reads_staging(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    first = TelemetryWriter(store, tmp_path / "t", CollectorMetrics())
    ingest(store, first, batch(0, T0), batch(1, T0 + 1))
    restarted = TelemetryWriter(store, tmp_path / "t", CollectorMetrics())  # nothing cached
    assert restarted.flush() == 6
    assert sorted(restarted.read()["seq"]) == [0, 0, 0, 1, 1, 1]


def test_concurrent_flushes_never_write_a_sample_twice(
        parts: tuple[StateStore, TelemetryWriter]) -> None:
    store, tel = parts
    ingest(store, tel, *(batch(i, T0 + i) for i in range(40)))
    threads = [threading.Thread(target=tel.flush, kwargs={"max_rows": 20}) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while tel.flush(max_rows=20):
        pass
    df = tel.read()
    assert len(df) == 120 and not df.duplicated(["seq", "gpu"]).any()


def test_recover_drops_files_a_crash_left_unrecorded(
        parts: tuple[StateStore, TelemetryWriter]) -> None:
    store, tel = parts
    ingest(store, tel, batch(0, T0))
    tel.flush()
    recorded = next(tel.root.glob("date=*/*.parquet"))
    # A crash after writing a file but before the transaction that records it and
    # deletes its staged rows: the staged rows are still there, the file is an orphan.
    ingest(store, tel, batch(1, T0))
    orphan = recorded.with_name("part-000000000002-000000000002.parquet")
    orphan.write_bytes(recorded.read_bytes())
    (recorded.parent / "part-x.parquet.tmp").write_bytes(b"torn")
    got = tel.recover()  # the orphan's rows are all in the recorded file: redundant
    assert sorted(p.name for p in got.removed) == ["part-000000000002-000000000002.parquet",
                                                   "part-x.parquet.tmp"]
    assert got.quarantined == []
    assert recorded.exists()
    tel.flush()
    df = tel.read()
    assert sorted(df["seq"]) == [0, 0, 0, 1, 1, 1]


def test_retention_prunes_old_days_and_rows(parts: tuple[StateStore, TelemetryWriter]) -> None:
    store, tel = parts
    ingest(store, tel, batch(0, T0), batch(1, T0 + 9 * DAY))
    tel.flush()
    assert tel.prune() == ["2023-11-14"]
    assert [p.name for p in tel.root.iterdir()] == ["date=2023-11-23"]
    assert len(tel.read()) == 3
    counts = store.prune(time.time() + 1)
    assert counts["batches"] == 2


def test_staging_log_holds_bodies_until_flushed_then_segments_go(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    log = StagingLog(tmp_path / "staging", segment_bytes=4096)  # a few batches a segment
    tel = TelemetryWriter(store, tmp_path / "t", CollectorMetrics(), staging=log)
    for i in range(10):  # one group commit each
        ingest(store, tel, batch(i, T0 + i))
    assert store.scalar("SELECT COUNT(*) FROM staged_samples WHERE length(body) > 0") == 0
    assert len(log.segments()) >= 3
    # A torn tail (a crash between the body's fsync and the commit) is never read.
    with open(tmp_path / "staging" / f"seg-{log.segments()[-1]:012d}.log", "ab") as fh:
        fh.write(b"\x85torn")
    log.close()
    # A restarted collector: nothing cached, bodies come back from the log.
    log2 = StagingLog(tmp_path / "staging", segment_bytes=4096)
    tel2 = TelemetryWriter(store, tmp_path / "t", CollectorMetrics(), staging=log2)
    assert tel2.flush(max_rows=12) == 12  # a first part only: its segments may go
    remaining = set(log2.segments())
    assert remaining and remaining == {r["segment"] for r in store.query(
        "SELECT DISTINCT segment FROM staged_samples")}
    assert tel2.flush() == 18
    assert log2.segments() == []
    df = tel2.read()
    assert len(df) == 30 and sorted(set(df["seq"])) == list(range(10))


def test_compaction_merges_a_finished_day_into_one_file(
        parts: tuple[StateStore, TelemetryWriter]) -> None:
    store, tel = parts
    for i in range(4):  # four flushes, four files for the same day
        ingest(store, tel, batch(i, T0 + i))
        tel.flush()
    ingest(store, tel, batch(9, T0 + 9 * DAY))  # "today" (the clock is T0 + 10 days)
    tel.flush()
    assert len(list(tel.root.glob("date=2023-11-14/*.parquet"))) == 4
    before = tel.read().sort_values(["seq", "gpu"]).reset_index(drop=True)
    assert tel.compact_old_days(now=T0 + 9 * DAY) == {"2023-11-14": 4}
    files = list(tel.root.glob("date=2023-11-14/*.parquet"))
    assert [f.name for f in files] == ["compact-000000000001-000000000004-4.parquet"]
    assert tel.recover().removed == []  # the new file is recorded, the old ones are gone
    after = tel.read().sort_values(["seq", "gpu"]).reset_index(drop=True)
    assert after.equals(before)
    assert tel.compact("2023-11-14") == 0


def test_a_damaged_staging_segment_is_skipped_counted_and_never_stalls_flushes(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "c.db")
    log = StagingLog(tmp_path / "staging", segment_bytes=4096)
    metrics = CollectorMetrics()
    tel = TelemetryWriter(store, tmp_path / "t", metrics, staging=log)
    for i in range(6):
        ingest(store, tel, batch(i, T0 + i))
    log.close()
    first = tmp_path / "staging" / f"seg-{log.segments()[0]:012d}.log"
    first.write_bytes(b"\x00" * 10)  # damaged: truncated and zeroed
    restarted = TelemetryWriter(store, tmp_path / "t", metrics,
                                staging=StagingLog(tmp_path / "staging", segment_bytes=4096))
    written = restarted.flush()
    lost = metrics.registry.get_sample_value("forewarn_collector_telemetry_flush_errors_total")
    assert lost is not None and lost >= 1
    assert written == 3 * (6 - int(lost))
    assert restarted.staged_samples() == 0 and restarted.flush() == 0
