"""The collector's data directory: start-up never deletes data on a guess (a database that
does not match the files beside it stops start-up; what recovery cannot account for goes to
quarantine), written Parquet is verified, a damaged file is found by the scrub and moved to
quarantine, and reads of the other files keep working."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forewarn.collector.cli import ServerThread
from forewarn.collector.config import CollectorConfig
from forewarn.collector.http.app import create_app
from forewarn.collector.http.auth import TokenRegistry, add_token
from forewarn.collector.ingest.batch import IngestWriter
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.staging import StagingLog
from forewarn.collector.storage.store import MIGRATIONS, Store
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.spawn.commands import collector_command, write_config
from forewarn.wire import AgentBatch, GpuSample, encode

from support.metrics import value
from support.polling import START_TIMEOUT_S, free_port, wait_for

DAY = 86400.0
T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


def batch(seq: int, t: float, n: int = 4) -> AgentBatch:
    return AgentBatch(node="n1", agent_id="a1", seq=seq, created=t, samples=[
        GpuSample(node="n1", gpu=g, time=t, source="sim", temperature_c=40.0 + g)
        for g in range(n)])


def ingest(store: Store, tel: TelemetryWriter, *batches: AgentBatch) -> None:
    writer = IngestWriter(store, tel.metrics, on_staged=tel.remember, staging=tel.staging)
    writer.start()
    try:
        for f in [writer.submit(b, encode(b)) for b in batches]:
            f.result(10)
    finally:
        writer.stop()


def open_parts(data: Path) -> tuple[Store, TelemetryWriter]:
    """The collector's store and telemetry writer on ``data``, as the service lays it out."""
    store = Store(data / "collector.db")
    return store, TelemetryWriter(store, data / "telemetry", CollectorMetrics(),
                                  staging=StagingLog(data / "staging"))


def close_parts(store: Store, tel: TelemetryWriter) -> None:
    assert tel.staging is not None
    tel.staging.close()
    store.close()


def parquet_files(data: Path) -> list[str]:
    return sorted(p.relative_to(data).as_posix() for p in data.glob("**/*.parquet"))


def history_in(data: Path, days: int, start: float = T0) -> None:
    """One flushed Parquet file per day, ``days`` days from ``start``, in ``data``."""
    store, tel = open_parts(data)
    for i in range(days):
        ingest(store, tel, batch(i, start + i * DAY))
        tel.flush()
    close_parts(store, tel)


def start_cli(tmp_path: Path, data: Path) -> tuple[subprocess.Popen[str], str]:
    """``forewarn collector`` on ``data`` (predictor off), its output piped: it may exit."""
    port = free_port()
    tokens = tmp_path / "tokens.toml"
    add_token(tokens, "n1")
    config = write_config(tmp_path / "collector.toml", listen=f"127.0.0.1:{port}",
                          data_dir=str(data), tokens_file=str(tokens), predictor_enabled=False)
    proc = subprocess.Popen(collector_command(config), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def run_cli_until_exit_or_up(tmp_path: Path, data: Path) -> tuple[int | None, str]:
    """Start the real collector on ``data``; (exit status or None if it came up, output)."""
    proc, url = start_cli(tmp_path, data)

    def exited_or_up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(exited_or_up, START_TIMEOUT_S, "collector exit or start")
    finally:
        came_up = proc.poll() is None
        if came_up:
            proc.terminate()
        out, _ = proc.communicate(timeout=30)
    return (None if came_up else proc.returncode), out


# -- point 3: start-up never deletes data on a guess -----------------------------------


@pytest.mark.parametrize("database", ["missing", "empty"])
def test_start_with_a_missing_or_empty_database_beside_parquet_stops_and_keeps_the_files(
        tmp_path: Path, database: str) -> None:
    data = tmp_path / "data"
    history_in(data, 2)
    files = parquet_files(data)
    assert len(files) == 2
    for suffix in ("", "-wal", "-shm"):
        (data / f"collector.db{suffix}").unlink(missing_ok=True)
    if database == "empty":
        (data / "collector.db").touch()
    status, out = run_cli_until_exit_or_up(tmp_path, data)
    assert parquet_files(data) == files, f"start-up removed Parquet files:\n{out}"
    assert status == 2, f"the collector started on a database that is not this data's:\n{out}"
    assert str(data / "collector.db") in out and str(data / "telemetry") in out
    assert "restore" in out.lower()  # it says what to do


def test_start_with_a_database_newer_than_the_code_stops_naming_the_path(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    history_in(data, 1)
    conn = sqlite3.connect(data / "collector.db")
    conn.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    conn.close()
    status, out = run_cli_until_exit_or_up(tmp_path, data)
    assert status == 2, out
    assert str(data / "collector.db") in out and "upgrade forewarn" in out
    assert len(parquet_files(data)) == 1


def serve(data: Path, **overrides: Any) -> tuple[ServerThread, Store, Any]:
    """The collector on ``data`` (a real start: uvicorn, lifespan); its app context."""
    cfg = CollectorConfig(listen="127.0.0.1:0", data_dir=data, flush_interval_s=3600,
                          tokens_file=data.parent / "none.toml", **overrides)
    store = Store(cfg.db_path)
    app = create_app(cfg, store, tokens=TokenRegistry(tokens={"n1": "t" * 20}))
    return ServerThread(app, cfg).start(), store, app.state.ctx


def quarantined(metrics: CollectorMetrics, reason: str) -> float:
    return value(metrics.registry, "forewarn_collector_quarantined_files_total", reason=reason)


def test_start_with_an_older_database_quarantines_the_newer_files_and_deletes_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    history_in(data, 1)
    backup = tmp_path / "backup.db"
    shutil.copy(data / "collector.db", backup)  # closed cleanly: no WAL to copy
    store, tel = open_parts(data)
    ingest(store, tel, batch(1, T0 + DAY))  # written after the backup ...
    tel.flush()
    ingest(store, tel, batch(2, T0 + DAY + 1))  # ... and staged after it
    close_parts(store, tel)
    newer = [f for f in parquet_files(data) if "2023-11-15" in f]
    segments = sorted(p.name for p in (data / "staging").iterdir())
    assert newer and segments
    for suffix in ("-wal", "-shm"):
        (data / f"collector.db{suffix}").unlink(missing_ok=True)
    shutil.copy(backup, data / "collector.db")  # the operator restores last week's backup

    caplog.set_level(logging.WARNING)
    server, store, ctx = serve(data)
    try:
        moved = sorted(p.relative_to(data / "quarantine").as_posix()
                       for p in (data / "quarantine").glob("**/*") if p.is_file())
        assert moved == sorted([*newer, *(f"staging/{s}" for s in segments)])
        assert quarantined(ctx.metrics, "unrecorded") == len(newer) + len(segments)
        assert "quarantine" in caplog.text and newer[0].split("/")[-1] in caplog.text
        # What the backup knows is still there.
        assert [f for f in parquet_files(data) if f.startswith("telemetry/")] == [
            f for f in parquet_files(data) if "2023-11-14" in f and "quarantine" not in f]
    finally:
        server.stop()
        store.close()


def test_a_staging_segment_beside_an_empty_database_is_quarantined_not_deleted(
        tmp_path: Path) -> None:
    # A collector killed in its very first group commit: the body is on disk, the
    # transaction never happened. Not a reason to refuse to start; not to delete either.
    data = tmp_path / "data"
    (data / "staging").mkdir(parents=True)
    (data / "staging" / "seg-000000000001.log").write_bytes(b"\x85body")
    server, store, ctx = serve(data)
    try:
        assert (data / "quarantine" / "staging" / "seg-000000000001.log").read_bytes() == (
            b"\x85body")
        assert quarantined(ctx.metrics, "unrecorded") == 1
    finally:
        server.stop()
        store.close()


def test_a_clean_restart_quarantines_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server, store, ctx = serve(data)
    ingest(store, ctx.telemetry, batch(0, time.time()))
    server.stop()  # the final flush writes Parquet and leaves no staged row
    store.close()
    server, store, ctx = serve(data)
    try:
        assert not (data / "quarantine").exists() or not any((data / "quarantine").iterdir())
        assert len(parquet_files(data)) == 1
    finally:
        server.stop()
        store.close()


def with_seq(table: pa.Table, seq: int) -> pa.Table:
    return table.set_column(table.schema.get_field_index("seq"), "seq",
                            pa.array([seq] * table.num_rows, pa.int64()))


def test_recovery_deletes_only_files_whose_every_row_is_held_elsewhere(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    store, tel = open_parts(data)
    ingest(store, tel, batch(0, T0))
    tel.flush()
    recorded = next(data.glob("telemetry/date=*/*.parquet"))
    table = pq.read_table(recorded)
    # A crash after writing a file but before the transaction that records it and deletes
    # its staged rows: every row of the orphan is still staged, so it is redundant.
    ingest(store, tel, batch(1, T0))
    pq.write_table(with_seq(table, 1), recorded.with_name("part-2-2.parquet"))
    # A compaction cut short: its rows are all in a recorded file of the same day.
    shutil.copy(recorded, recorded.with_name("compact-1-1-1.parquet"))
    (recorded.parent / "part-x.parquet.tmp").write_bytes(b"torn")  # never renamed
    # Rows nothing else holds (seq 7): not redundant, so kept in quarantine.
    pq.write_table(with_seq(table, 7), recorded.with_name("part-9-9.parquet"))
    got = tel.recover()
    assert sorted(p.name for p in got.removed) == [
        "compact-1-1-1.parquet", "part-2-2.parquet", "part-x.parquet.tmp"]
    assert [p.name for p in got.quarantined] == ["part-9-9.parquet"]
    assert (data / "quarantine" / "telemetry" / recorded.parent.name / "part-9-9.parquet"
            ).exists()
    tel.flush()
    assert sorted(tel.read()["seq"]) == [0] * 4 + [1] * 4
    close_parts(store, tel)


def test_a_batch_staged_in_a_segment_that_is_gone_does_not_make_its_file_redundant(
        tmp_path: Path) -> None:
    """An older database can name a batch as staged in a segment a later flush deleted: the
    Parquet file holding it is then its only copy (chaos collector_mismatched_db lost rows
    this way: recovery deleted the file, then found the staged body unreadable)."""
    data = tmp_path / "data"
    store, tel = open_parts(data)
    ingest(store, tel, batch(0, T0))
    tel.flush()
    recorded = next(data.glob("telemetry/date=*/*.parquet"))
    ingest(store, tel, batch(1, T0))
    pq.write_table(with_seq(pq.read_table(recorded), 1), recorded.with_name("part-2-2.parquet"))
    segments = list((data / "staging").glob("seg-*.log"))
    assert segments, "batch 1 is staged in a segment"
    for seg in segments:
        seg.unlink()
    got = tel.recover()
    assert [p.name for p in got.quarantined] == ["part-2-2.parquet"], got
    assert not [p for p in got.removed if p.suffix == ".parquet"]
    close_parts(store, tel)


# -- point 14: damaged Parquet files -----------------------------------------------------


def damage(path: Path) -> None:
    """Flip bytes in the middle of a file (its data pages), leaving the footer intact."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 3
    for i in range(middle, middle + 64):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_reads_across_days_keep_working_when_one_file_is_damaged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    history_in(data, 3)
    store, tel = open_parts(data)
    damaged = next(data.glob("telemetry/date=2023-11-15/*.parquet"))
    damage(damaged)
    try:
        df = tel.read(start=T0 - DAY, end=T0 + 5 * DAY)
        assert sorted(set(df["seq"])) == [0, 2]  # the other days, whole
        assert len(df) == 8
        errors = tel.metrics.registry.get_sample_value(
            "forewarn_collector_telemetry_read_errors_total")
        assert errors == 1
    finally:
        close_parts(store, tel)


def test_scrub_moves_a_damaged_file_to_quarantine_and_reports_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    history_in(data, 3)
    store, tel = open_parts(data)
    damaged = next(data.glob("telemetry/date=2023-11-15/*.parquet"))
    damage(damaged)
    truncated = next(data.glob("telemetry/date=2023-11-16/*.parquet"))
    truncated.write_bytes(truncated.read_bytes()[:-20])  # a torn footer
    caplog.set_level(logging.ERROR)
    try:
        found = tel.scrub()
        assert sorted(found) == sorted(p.relative_to(data / "telemetry").as_posix()
                                       for p in (damaged, truncated))
        for path in (damaged, truncated):
            assert not path.exists()
            assert (data / "quarantine" / "telemetry" / path.parent.name / path.name).exists()
            assert path.name in caplog.text
        assert quarantined(tel.metrics, "damaged") == 2
        assert store.scalar("SELECT COUNT(*) FROM telemetry_files") == 1
        assert tel.scrub() == []  # the good file passes; nothing is reported twice
        assert sorted(set(tel.read()["seq"])) == [0]
    finally:
        close_parts(store, tel)


def test_the_running_collector_scrubs_periodically(tmp_path: Path) -> None:
    data = tmp_path / "data"
    history_in(data, 2, start=time.time() - 3 * DAY)  # within the retention
    server, store, ctx = serve(data, scrub_interval_s=0.2)
    try:
        damaged = sorted(data.glob("telemetry/date=*/*.parquet"))[1]
        time.sleep(0.5)  # a first scrub has passed it
        damage(damaged)
        wait_for(lambda: quarantined(ctx.metrics, "damaged") == 1, timeout=30,
                 what="the scrub to find the damaged file")
        assert (data / "quarantine" / "telemetry" / damaged.parent.name / damaged.name).exists()
    finally:
        server.stop()
        store.close()


def test_a_written_file_is_verified_by_reading_its_footer_back(tmp_path: Path) -> None:
    from forewarn.collector.storage.parquet_layout import TelemetryError, verify_parquet

    data = tmp_path / "data"
    history_in(data, 1)
    path = next(data.glob("telemetry/date=*/*.parquet"))
    verify_parquet(path, rows=4)  # a good file passes
    with pytest.raises(TelemetryError, match="rows"):
        verify_parquet(path, rows=5)
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(TelemetryError, match=path.name):
        verify_parquet(path, rows=4)


def test_compaction_sets_a_damaged_file_aside_and_keeps_the_rest(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store, tel = open_parts(data)
    for i in range(3):  # three files of one day
        ingest(store, tel, batch(i, T0 + i))
        tel.flush()
    files = sorted(data.glob("telemetry/date=*/*.parquet"))
    damage(files[1])
    try:
        assert tel.compact_old_days(now=T0 + 2 * DAY) == {"2023-11-14": 0}
        assert (data / "quarantine" / "telemetry" / files[1].parent.name / files[1].name
                ).exists()
        assert tel.compact_old_days(now=T0 + 2 * DAY) == {"2023-11-14": 2}  # the rest
        assert sorted(set(tel.read()["seq"])) == [0, 2]
        assert quarantined(tel.metrics, "damaged") == 1
    finally:
        close_parts(store, tel)
