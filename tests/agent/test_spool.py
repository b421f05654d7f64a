"""The uplink's spool across an agent restart (the batches themselves: test_uplink.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from forewarn.agent.spool import Spool
from forewarn.wire import AgentBatch, GpuSample


def batch(aid: str, seq: int) -> AgentBatch:
    return AgentBatch(node="a", agent_id=aid, seq=seq, created=1.0, samples=[
        GpuSample(node="a", gpu=g, time=1.0, source="sim", simulated=True, temperature_c=50.0)
        for g in range(8)])


def fill(spool: Spool, n: int, make: Callable[[str, int], AgentBatch] = batch) -> None:
    for _ in range(n):
        spool.append(make)


def test_a_batch_in_doubt_stays_in_doubt_after_a_restart(tmp_path: Path) -> None:
    """A batch sent without an answer may be stored; an agent restarted before the answer
    must not drop it under the bound and count it lost."""
    spool = Spool(tmp_path, max_bytes=1 << 20)
    fill(spool, 3)
    spool.in_doubt(0)
    size = spool.bytes // 3
    again = Spool(tmp_path, max_bytes=3 * size)  # the restarted agent; the bound now bites
    fill(again, 2)
    assert 0 in [s for s, _ in again.pending()], "the batch in doubt was dropped"
    assert again.dropped == 2 and len(again) == 3  # seqs 1 and 2 went, oldest first
    again.remove(0)  # answered: no longer in doubt, and not after another restart either
    third = Spool(tmp_path, max_bytes=size)
    fill(third, 1)
    assert [s for s, _ in third.pending()] == [5]
