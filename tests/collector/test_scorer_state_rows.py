"""The scorer state row as the store holds it (:mod:`forewarn.collector.decide.
scorer_state`), on SQLite and PostgreSQL: a row larger than any snapshot the collector
writes is refused from its length, never read into the collector's memory; a snapshot a
newer forewarn wrote (another format, feature grid or set of state arrays), refused by an
older replica during a rolling upgrade, stays in place for the newer replicas."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from forewarn.collector.decide.scorer_state import ScorerSnapshots
from forewarn.collector.storage.state import StateStore
from forewarn.models.features import GRID_S
from forewarn.models.live import LiveScorer
from forewarn.models.live_state import Captured, capture, encode
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import GpuSample

T0 = 1.75e9


def fed(minutes: range) -> LiveScorer:
    """A scorer that has seen two GPUs for ``minutes``."""
    scorer = LiveScorer(FailurePredictor(classifier=None))
    for m in minutes:
        for g in range(2):
            scorer.observe(GpuSample(node="n0", gpu=g, time=T0 + m * GRID_S + 1,
                                     source="test", temperature_c=60.0 + g, power_w=400.0))
    return scorer


def newer_format(c: Captured) -> None:
    c.meta["format"] = int(c.meta["format"]) + 1


def newer_grid(c: Captured) -> None:
    c.meta["layout"]["cum"].append("fan_speed")


def newer_array(c: Captured) -> None:
    c.arrays["_thermal"] = np.zeros(2)


def stored(state: StateStore) -> list[tuple[float, bytes]]:
    return [(float(r["time"]), bytes(r["body"]))
            for r in state.query("SELECT time, body FROM scorer_state")]


@pytest.mark.parametrize("newer", [newer_format, newer_grid, newer_array])
def test_a_newer_versions_snapshot_is_left_in_place(
        backend_state: StateStore, newer: Callable[[Captured], None]) -> None:
    """An older replica refuses it and starts fresh, but neither deletes it nor saves its
    own state over it: the newer replicas that lead after the upgrade restore it."""
    c = capture(fed(range(30)), T0 + 30 * GRID_S)
    newer(c)
    body = encode(c)
    with backend_state.write() as tx:
        tx.execute("INSERT INTO scorer_state (name, time, gpus, body) VALUES (?, ?, ?, ?)",
                   ("live_scorer", c.held, c.gpus, body))
    old = ScorerSnapshots(backend_state)
    try:
        assert old.load(LiveScorer(FailurePredictor(classifier=None)), T0 + 31 * GRID_S,
                        None) is False
        assert old.counts["refused"] == 1
        assert stored(backend_state) == [(c.held, body)]
        old.save(fed(range(40)), T0 + 40 * GRID_S, wait=True)  # newer than the row
        assert stored(backend_state) == [(c.held, body)]
        assert old.counts["saved"] == 0 and old.counts["superseded"] == 1
    finally:
        old.close()


def test_a_corrupt_snapshot_is_deleted(backend_state: StateStore) -> None:
    with backend_state.write() as tx:
        tx.execute("INSERT INTO scorer_state (name, time, gpus, body) VALUES (?, ?, ?, ?)",
                   ("live_scorer", T0, 2, b"PK\x03\x04 not an archive"))
    snaps = ScorerSnapshots(backend_state)
    try:
        assert snaps.load(LiveScorer(FailurePredictor(classifier=None)), T0 + 60, None) is False
        assert snaps.counts["refused"] == 1 and stored(backend_state) == []
        snaps.save(fed(range(5)), T0 + 5 * GRID_S, wait=True)
        assert snaps.counts["saved"] == 1 and len(stored(backend_state)) == 1
    finally:
        snaps.close()


def test_a_row_over_the_size_bound_is_refused_unread(backend_state: StateStore) -> None:
    body = bytes(8 << 20)
    with backend_state.write() as tx:
        tx.execute("INSERT INTO scorer_state (name, time, gpus, body) VALUES (?, ?, ?, ?)",
                   ("live_scorer", 1.75e9, 1, body))
    del body
    snaps = ScorerSnapshots(backend_state, max_bytes=1 << 20)
    scorer = LiveScorer(FailurePredictor(classifier=None))
    tracemalloc.start()
    try:
        assert snaps.load(scorer, 1.75e9 + 60, None) is False
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB read to refuse it"
    assert snaps.counts["refused"] == 1
    assert not backend_state.query("SELECT name FROM scorer_state")  # the next save lands
