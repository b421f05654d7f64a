"""Small helpers the checks share: building findings, counter deltas and flag fractions
over a window of a GPU's recent samples."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from forewarn.agent.state import AgentState, GpuHistory
from forewarn.wire import Evidence, Finding, GpuSample, GpuState, Health, Subject, SuggestedAction

__all__ = ["counter_delta", "flag_fraction", "gpu_finding", "live_gpus"]


def gpu_finding(
    check: str,
    state: AgentState,
    hist: GpuHistory,
    now: float,
    health: Health,
    reason: str,
    action: SuggestedAction = SuggestedAction.NONE,
    evidence: Evidence | None = None,
) -> Finding:
    """A finding about one GPU of this node, marked simulated when its data is."""
    last = hist.last
    return Finding(
        check=check,
        health=health,
        subject=Subject(kind="gpu", node=state.node, gpu=hist.info.index),
        reason=reason[:4000],
        action=action,
        evidence=dict(evidence or {}),
        time=now,
        simulated=bool(last is not None and last.simulated),
    )


def live_gpus(state: AgentState) -> Iterator[tuple[GpuHistory, GpuSample]]:
    """GPUs whose latest sample answered (state ok), with that sample, by index."""
    for _index, hist in sorted(state.gpus.items()):
        last = hist.last
        if last is not None and last.state == GpuState.OK:
            yield hist, last


def counter_delta(
    hist: GpuHistory, get: Callable[[GpuSample], int | None], now: float, window_s: float
) -> tuple[int, float] | None:
    """Increase of a cumulative counter over the last ``window_s`` and the span it covers.

    Uses the newest sample at or before ``now - window_s`` as the base (or the oldest
    sample kept when the history is shorter). A counter that went down (driver reload,
    GPU reset clears volatile counters) counts from zero at the reset. Returns None
    when fewer than two samples carry the counter.
    """
    last = hist.last
    if last is None or get(last) is None:
        return None
    base = hist.at_or_before(now - window_s)
    if base is None or get(base) is None:
        base = next((s for s in hist.samples if get(s) is not None), None)
    if base is None or base is last:
        return None
    total = 0
    prev = get(base)
    started = False
    for s in hist.samples:
        if s is base:
            started = True
            continue
        if not started:
            continue
        v = get(s)
        if v is None or prev is None:
            prev = v if v is not None else prev
            continue
        total += v - prev if v >= prev else v
        prev = v
    return total, last.time - base.time


def flag_fraction(
    hist: GpuHistory, test: Callable[[GpuSample], bool | None], now: float, window_s: float
) -> tuple[float, int]:
    """Share of the samples in the last ``window_s`` where ``test`` is true (samples where
    it is None are left out), and how many samples were judged."""
    hits = judged = 0
    for s in reversed(hist.samples):
        if s.time < now - window_s:
            break
        v = test(s)
        if v is None:
            continue
        judged += 1
        hits += bool(v)
    return (hits / judged if judged else 0.0), judged
