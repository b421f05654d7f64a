"""Telemetry accounting: what an agent produced against what its collector stored.

Run after both have stopped (the agent first, gracefully, so its spool is empty or holds
what it could not send; then the collector, so its last samples are flushed). Produced =
the batches the agent sealed into its spool (``state.json``'s ``next_seq``: every sealed
batch got the next seq, and a sealed batch is durable). Stored = the collector's
``batches`` rows for that ``agent_id`` (each ``(agent_id, seq)`` once), and the GPU
samples in its telemetry history (Parquet plus staged) for that agent.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Account", "account"]


@dataclasses.dataclass
class Account:
    """Batches and samples, produced against stored."""

    agent_id: str
    produced_batches: int
    stored_batches: int
    missing_seqs: list[int]
    spooled_left: int
    samples_in_batches: int
    samples_stored: int
    duplicate_samples: int
    max_gap_s: float
    """Largest gap between consecutive samples of one GPU outside the excused windows."""
    gaps: list[tuple[float, float]]
    """(start, end) of sample gaps over the allowed gap, outside the excused windows."""
    excused_gaps: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """(start, end) of the sample gaps that overlap an excused window."""

    @property
    def lost_batches(self) -> int:
        return len(self.missing_seqs)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["missing_seqs"] = _ranges(self.missing_seqs)
        return d


def _ranges(seqs: list[int]) -> list[str]:
    out: list[str] = []
    for s in seqs:
        if out and int(out[-1].split("-")[-1]) == s - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return out


def account(spool_dir: Path, data_dir: Path, *, node: str, allowed_gap_s: float,
            excused: Sequence[tuple[float, float]] = ()) -> Account:
    """Count what the agent of ``node`` with spool ``spool_dir`` produced and what the
    collector with data ``data_dir`` stored (both stopped). Only rows stored for ``node``
    count: a batch another node sent under this agent's id is not this agent's. Gaps that
    overlap an ``excused`` window (the agent was not running) are not counted."""
    from forewarn.collector.metrics import CollectorMetrics
    from forewarn.collector.storage.staging import StagingLog
    from forewarn.collector.storage.store import Store
    from forewarn.collector.storage.telemetry import TelemetryWriter

    state = json.loads((spool_dir / "state.json").read_text())
    agent_id, produced = str(state["agent_id"]), int(state["next_seq"])
    left = len(list(spool_dir.glob("*.msgpack")))
    store = Store(data_dir / "collector.db")
    try:
        # Rows the collector staged but had not yet written to Parquet when it was killed
        # live in its staging log: read them there, as the restarted collector would.
        telemetry = TelemetryWriter(store, data_dir / "telemetry", CollectorMetrics(),
                                    staging=StagingLog(data_dir / "staging"))
        telemetry.recover()
        rows = store.query("SELECT seq, samples FROM batches WHERE agent_id = ? AND node = ?"
                           " ORDER BY seq", (agent_id, node))
        seqs = {int(r["seq"]) for r in rows}
        in_batches = sum(int(r["samples"]) for r in rows)
        history = telemetry.read()
    finally:
        store.close()
    mine = history[(history["agent_id"] == agent_id) & (history["node"] == node)] \
        if len(history) else history
    dups = int(mine.duplicated(["seq", "gpu", "time"]).sum()) if len(mine) else 0
    max_gap, gaps, excused_gaps = 0.0, [], []
    if len(mine):
        for _gpu, times in mine.groupby("gpu")["time"]:
            ts = sorted(float(t) for t in times)
            for a, b in itertools.pairwise(ts):
                if any(a < e1 and b > e0 for e0, e1 in excused):
                    if b - a > allowed_gap_s:
                        excused_gaps.append((a, b))
                    continue
                max_gap = max(max_gap, b - a)
                if b - a > allowed_gap_s:
                    gaps.append((a, b))
    return Account(
        agent_id=agent_id, produced_batches=produced, stored_batches=len(seqs),
        missing_seqs=sorted(set(range(produced)) - seqs), spooled_left=left,
        samples_in_batches=in_batches, samples_stored=len(mine), duplicate_samples=dups,
        max_gap_s=round(max_gap, 3), gaps=gaps, excused_gaps=excused_gaps)
