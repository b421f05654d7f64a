"""Small helpers the checks share: building findings, counter deltas and flag fractions
over a window of a GPU's recent samples."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator

from forewarn.agent.state import AgentState, GpuHistory
from forewarn.wire import Evidence, Finding, GpuSample, GpuState, Health, Subject, SuggestedAction

__all__ = ["counter_delta", "flag_fraction", "gpu_finding", "live_gpus", "window_start"]


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


def window_start(hist: GpuHistory, now: float, window_s: float) -> int:
    """Index of the newest sample at or before ``now - window_s`` (0 when the history is
    shorter): the base of a window, found by bisection."""
    return max(0, bisect.bisect_right(hist.samples, now - window_s, key=_time) - 1)


def counter_delta(
    hist: GpuHistory, get: Callable[[GpuSample], int | None], now: float, window_s: float,
    *, start: int | None = None,
) -> tuple[int, float] | None:
    """Increase of a cumulative counter over the last ``window_s`` and the span it covers.

    Uses the newest sample at or before ``now - window_s`` as the base (or the oldest
    sample kept when the history is shorter). A counter that went down (driver reload,
    GPU reset clears volatile counters) counts from zero at the reset. Returns None
    when fewer than two samples carry the counter.

    Cost: a bisection plus O(1) in the usual case (the counter did not go down); only a
    reset walks the window. Checks call this for every counter of every NVLink link
    every poll, so it must not walk 15 minutes of history each time. ``start`` is
    :func:`window_start` precomputed for the same window (many counters, one bisection).
    """
    samples = hist.samples
    if len(samples) < 2:
        return None
    last = samples[-1]
    v_last = get(last)
    if v_last is None:
        return None
    i = window_start(hist, now, window_s) if start is None else start
    v_base = get(samples[i])
    while v_base is None and i < len(samples) - 1:
        i += 1
        v_base = get(samples[i])
    base = samples[i]
    if v_base is None or base is last:
        return None
    if v_last >= v_base:
        return v_last - v_base, last.time - base.time
    total, prev = 0, v_base
    for s in itertools.islice(samples, i + 1, None):
        v = get(s)
        if v is None:
            continue
        total += v - prev if v >= prev else v
        prev = v
    return total, last.time - base.time


def _time(s: GpuSample) -> float:
    return s.time


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
