"""A collector data directory holding a simulated fleet's history, written through the
collector's own ingest and storage code (staged, then flushed to Parquet)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pandas as pd

from forewarn.collector.ingest.batch import IngestWriter
from forewarn.collector.storage.state import StateStore
from forewarn.collector.storage.telemetry import TelemetryWriter
from forewarn.wire import AgentBatch, GpuSample, XidEvent, encode

_NVLINK_KEYS = ("crc_flit", "crc_data", "replay", "recovery")


def _value(v: Any) -> Any:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return v.item() if hasattr(v, "item") else v


def _sample(row: dict[str, Any]) -> GpuSample:
    links: dict[int, dict[str, int]] = {}
    fields: dict[str, Any] = {}
    for col, v in row.items():
        value = _value(v)
        if col.startswith("nvlink") and col[6:7].isdigit():
            link, key = col[6:].split("_", 1)
            if value is not None:
                links.setdefault(int(link), {})[key] = int(value)
        elif col in GpuSample.__struct_fields__ and value is not None:
            fields[col] = value
    fields["nvlink"] = [{"link": k, **{n: v.get(n) for n in _NVLINK_KEYS}}
                        for k, v in sorted(links.items())]
    return msgspec.convert({"source": "sim", **fields}, GpuSample)


def fleet_batches(samples: pd.DataFrame, xids: pd.DataFrame, hours: float
                  ) -> Iterator[AgentBatch]:
    """The fleet's samples and XIDs as agent batches, one per node per ``hours``."""
    span = hours * 3600.0
    x = xids.rename(columns={"xid": "code"})
    seqs: dict[str, int] = {}
    for (node, block), part in samples.groupby(
            [samples["node"], samples["time"] // span], sort=True):
        xs = x[(x["node"] == node) & (x["time"] // span == block)]
        seq = seqs.get(str(node), 0)
        seqs[str(node)] = seq + 1
        yield AgentBatch(
            node=str(node), agent_id=f"agent-{node}", seq=seq,
            created=float(part["time"].max()),
            samples=[_sample(r) for r in part.to_dict("records")],
            xids=[XidEvent(node=str(node), gpu=int(r["gpu"]), code=int(r["code"]),
                           time=float(r["time"]), source="sim")
                  for r in xs.to_dict("records")])


def store_fleet(store: StateStore, telemetry: TelemetryWriter, samples: pd.DataFrame,
                xids: pd.DataFrame, *, hours_per_batch: float = 2.0) -> int:
    """Ingest ``samples`` and ``xids`` (the simulator's frames) as agent batches and flush
    them to Parquet; returns the samples flushed."""
    writer = IngestWriter(store, telemetry.metrics, on_staged=telemetry.remember,
                          staging=telemetry.staging, clock=lambda: float(samples["time"].max()))
    writer.start()
    try:
        futures = [writer.submit(b, encode(b))
                   for b in fleet_batches(samples, xids, hours_per_batch)]
        for f in futures:
            f.result(60)
    finally:
        writer.stop()
    return telemetry.flush(max_rows=10_000_000)


def record_drains(store: StateStore, drains: Sequence[tuple[str, float, str]]) -> None:
    """Record drain actions as the collector's actions do: (subject, time, status)."""
    for subject, t, status in drains:
        node = subject.split(":", 1)[1].split("/", 1)[0]
        store.record_action(time=t, kind="drain", subject=subject, node=node, status=status,
                            detail={"argv": ["true"]})
