"""Small helpers the checks share: building findings, counter deltas and flag fractions
over a window of a GPU's recent samples, and the base of the checks over training ranks."""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Callable, Iterator

from forewarn.agent.state import AgentState, GpuHistory
from forewarn.wire import Evidence, Finding, GpuSample, GpuState, Health, Subject, SuggestedAction

__all__ = ["RankCheck", "WindowFraction", "counter_delta", "gpu_finding", "live_gpus",
           "window_start"]


class RankCheck:
    """Base of the checks over the training ranks (``AgentState.ranks``, filled by the rank
    component): they apply once ``min_ranks`` ranks have reported."""

    min_ranks = 1

    def applies(self, state: AgentState) -> bool:
        return state.ranks is not None and len(state.ranks) >= self.min_ranks


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


class WindowFraction:
    """Share of each GPU's samples in the last ``window_s`` where ``test`` is true
    (samples where it is None are left out), and how many samples were judged: walking
    back from the newest sample to the first one older than ``now - window_s``.

    Kept incrementally per GPU: a call tests only the samples added since the previous
    call and forgets those that left the window, so a poll costs O(new samples) instead
    of a walk over the window for every GPU (the thermal and power-brake checks ask for
    every GPU every second). While the clock has stepped back (a sample older than the
    one before it is still counted, or ``now`` is earlier than a previous call's) the
    answer comes from the plain walk, so it is the same in every case.
    """

    def __init__(self, test: Callable[[GpuSample], bool | None], window_s: float) -> None:
        self.test = test
        self.window_s = window_s
        self._tallies: dict[int, _Tally] = {}

    def __call__(self, hist: GpuHistory, now: float) -> tuple[float, int]:
        samples = hist.samples
        index = hist.info.index
        tally = self._tallies.get(index)
        fresh: list[GpuSample] = []
        if tally is None:
            tally = self._tallies[index] = _Tally()
        # New samples: those after the newest one counted (all of them when it was pruned
        # or the history replaced; forget_before then drops what the history no longer has).
        for s in reversed(samples):
            if s is tally.newest:
                break
            fresh.append(s)
        for s in reversed(fresh):
            tally.add(s, self.test(s))
        tally.newest = samples[-1] if samples else None
        # Forget what left the window, and what the history itself pruned.
        tally.forget_before(max(now - self.window_s, samples[0].time if samples else now))
        stepped_back = tally.descents > 0 or now < tally.latest_now
        tally.latest_now = max(tally.latest_now, now)
        if stepped_back:
            return self._walk(hist, now)
        return (tally.hits / tally.judged if tally.judged else 0.0), tally.judged

    def _walk(self, hist: GpuHistory, now: float) -> tuple[float, int]:
        hits = judged = 0
        for s in reversed(hist.samples):
            if s.time < now - self.window_s:
                break
            v = self.test(s)
            if v is None:
                continue
            judged += 1
            hits += bool(v)
        return (hits / judged if judged else 0.0), judged


class _Tally:
    """The samples of one GPU still in the window, with their test results, in order."""

    def __init__(self) -> None:
        self.newest: GpuSample | None = None
        self.items: collections.deque[tuple[float, bool | None]] = collections.deque()
        self.hits = 0
        self.judged = 0
        self.descents = 0
        """Neighbouring items whose time goes down (the clock stepped back)."""
        self.latest_now = -math.inf

    def add(self, s: GpuSample, v: bool | None) -> None:
        if self.items and s.time < self.items[-1][0]:
            self.descents += 1
        self.items.append((s.time, v))
        if v is not None:
            self.judged += 1
            self.hits += bool(v)

    def forget_before(self, t: float) -> None:
        items = self.items
        while items and items[0][0] < t:
            old, v = items.popleft()
            if items and old > items[0][0]:
                self.descents -= 1
            if v is not None:
                self.judged -= 1
                self.hits -= bool(v)
