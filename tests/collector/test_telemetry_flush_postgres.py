"""The Parquet flush on shared PostgreSQL state deletes exactly the staged rows it wrote
(issue 16). Identity ids are handed out when a row is inserted, not when it commits, so
with two replicas ingesting, a row whose id lies inside the range a flush read may commit
after the flush read the staged rows: a delete by id range removed it, never written."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pyarrow.parquet as pq

from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.postgres import PostgresStore
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.demo.servers import PostgresServer
from forewarn.wire import AgentBatch, GpuSample, encode

INSERT = ("INSERT INTO staged_samples (agent_id, seq, samples, body) VALUES (%s, %s, %s, %s)"
          " RETURNING id")


def staged_row(agent_id: str) -> tuple[str, int, int, bytes]:
    t = time.time() - 5
    samples = [GpuSample(node="n1", gpu=g, time=t, source="sim", simulated=True,
                         temperature_c=50.0) for g in range(4)]
    body = encode(AgentBatch(node="n1", agent_id=agent_id, seq=1, created=t, samples=samples))
    return agent_id, 1, len(samples), body


class CommitWhenAsked:
    """The flush's clock: the first time the flush asks for the time (after it read the
    staged rows and wrote Parquet, before it records the file and deletes the rows), the
    other replica's ingest transaction commits."""

    def __init__(self, conn: psycopg.Connection[tuple[int]]) -> None:
        self.conn = conn

    def __call__(self) -> float:
        if not self.conn.closed:
            self.conn.commit()
            self.conn.close()
        return time.time()


def parquet_rows(root: Path) -> int:
    return sum(pq.read_metadata(f).num_rows for f in root.rglob("*.parquet"))


def test_a_row_committed_inside_the_flushed_range_after_the_read_stays_staged(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    dsn = postgres_server.database()
    store = PostgresStore(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True) as other:  # replica B's, committed
            before = other.execute(INSERT, staged_row("agent-b0")).fetchone()
            late = psycopg.connect(dsn)  # replica A's group commit, still open
            inside = late.execute(INSERT, staged_row("agent-a")).fetchone()
            after = other.execute(INSERT, staged_row("agent-b1")).fetchone()
        assert before and inside and after and before[0] < inside[0] < after[0]
        root = tmp_path / "telemetry"
        writer = TelemetryWriter(store, root, CollectorMetrics(), clock=CommitWhenAsked(late))
        assert writer.flush() == 8  # agent-b0's and b1's: agent-a's row was not committed
        left = [r["agent_id"] for r in store.query("SELECT agent_id FROM staged_samples")]
        assert left == ["agent-a"], "a row committed after the flush read was deleted unwritten"
        assert writer.flush() == 4
        assert parquet_rows(root) == 12
    finally:
        store.close()
