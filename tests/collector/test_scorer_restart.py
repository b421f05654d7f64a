"""A collector restarted on its store keeps what its live scorer learned: every GPU's own
baseline (a gauge against its own long-run level alarms right after the restart, as in a
collector that never stopped) and its alarm memory (a GPU whose false alarm raised its bar
does not alarm again at the same score). Real collectors (uvicorn on loopback, SQLite),
stopped and started again on the same data dir; the classifier at the model seam reads two
features, so the test knows which GPU should alarm when.

Figures from the code: the own baseline ends at the last 240-minute block boundary but one
(``BASELINE_BLOCK``) and needs 120 minutes of history (``BASELINE_MIN_MINUTES``), so a
scorer that starts fresh has none for 4 to 8 hours; a false alarm raises a GPU's bar from
the model's threshold 0.5 to 0.75 (``bar_step`` 0.5) for a week.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from forewarn.models.features import BASELINE_BLOCK, FEATURE_NAMES, GRID_S
from forewarn.wire import AgentBatch, GpuSample, encode

from support.collector import NODE, NODE_TOKENS, Clock, serve_predictor
from support.polling import poll

pytestmark = pytest.mark.system

_ECC = FEATURE_NAMES.index("ecc_d5")
_TEMP = FEATURE_NAMES.index("temp_vs_own")
# 120 minutes before a block boundary: the first boundary gives a 120-minute baseline.
_T0 = float((1_750_000_000 // 60 // BASELINE_BLOCK * BASELINE_BLOCK + BASELINE_BLOCK - 120)
            * 60)
_BATCH_MIN = 10
_RESTART_MIN = 420  # 7 h: the baseline (minutes 0-120) is in use from minute 360
_HOT_FROM = 430  # GPU 2 runs 18 C above its own level from here
_BURSTS = {209: 70, 469: 70}  # GPU 3's correctable ECC errors in that minute


class _Rules:
    """p = the larger of (GPU's correctable ECC errors of the last 5 minutes beyond its
    own baseline) / 100 and (its temperature above its own long-run level) / 20."""

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        p = np.clip(np.maximum(np.expm1(x[:, _ECC]) / 100.0, x[:, _TEMP] / 20.0), 0.0, 1.0)
        return np.column_stack([1 - p, p])


def _samples(minute: int) -> list[GpuSample]:
    ecc = sum(v for m, v in _BURSTS.items() if m <= minute)
    return [GpuSample(node=NODE, gpu=g, time=_T0 + minute * GRID_S + 1, source="test",
                      temperature_c=78.0 if g == 2 and minute >= _HOT_FROM else 60.0,
                      power_w=500.0, power_limit_w=700.0,
                      ecc_corrected_volatile=ecc if g == 3 else 0, pcie_replay_total=0)
            for g in range(4)]


class _Collector:
    """One collector on ``tmp``'s data dir, fed ten minutes of telemetry a batch."""

    def __init__(self, tmp: Path, clock: Clock, seq: int = 0, **config: Any) -> None:
        self.clock, self.seq, self.stopped = clock, seq, False
        self.server, self.store, self.predictor, self.ctx = serve_predictor(
            tmp, _Rules(), clock, **config)
        self.predictor.interval_s = _BATCH_MIN * GRID_S  # every batch is scored
        self.predictor.refresh_s = 0.0  # every alarmed scoring stores its finding

    def push(self, first_minute: int) -> None:
        minutes = range(first_minute, first_minute + _BATCH_MIN)
        self.clock.t = _T0 + (first_minute + _BATCH_MIN) * GRID_S + 1
        b = AgentBatch(node=NODE, agent_id="agent-0", seq=self.seq, created=self.clock.t,
                       samples=[s for m in minutes for s in _samples(m)])
        self.seq += 1
        import httpx

        r = httpx.post(f"{self.server.url}/api/v1/ingest", content=encode(b), headers={
            "content-type": "application/msgpack",
            "authorization": f"Bearer {NODE_TOKENS[NODE]}"}, timeout=30)
        assert r.status_code == 200, r.text
        assert poll(lambda: self.predictor.last_score == self.clock.t, interval=0.01), \
            f"batch of minute {first_minute} not scored"

    def alarms(self, since_minute: int) -> set[tuple[int, int]]:
        """(GPU, minute scored) of the predictor's alarms stored from ``since_minute`` to
        the last scoring but one (the last one's findings may still be on their way)."""
        rows = self.store.query(
            "SELECT gpu, time FROM findings WHERE check_name = 'models.failure_predictor'"
            " AND health IN ('degraded', 'unhealthy') AND time >= ? AND time < ?",
            (_T0 + since_minute * GRID_S, self.clock.t - 1))
        return {(int(r["gpu"]), round((float(r["time"]) - _T0) / GRID_S)) for r in rows}

    def stop(self) -> None:
        """Stop it (again: nothing)."""
        if not self.stopped:
            self.stopped = True
            self.server.stop()
            self.store.close()


def _run(tmp: Path, restart: bool) -> tuple[set[tuple[int, int]], dict[str, Any]]:
    """Telemetry up to minute 480, the collector restarted at :data:`_RESTART_MIN` when
    ``restart``; the alarms after it and the restarted predictor's shadow counts."""
    c = _Collector(tmp, Clock(_T0))
    assert c.predictor.snapshots is not None
    c.predictor.snapshots.every_s = 1e9  # one save at the first scoring, one at the stop
    for m in range(0, _RESTART_MIN, _BATCH_MIN):
        c.push(m)
    if restart:
        c.stop()
        c = _Collector(tmp, Clock(c.clock.t + 30.0), seq=c.seq)
    for m in range(_RESTART_MIN, 480, _BATCH_MIN):
        c.push(m)
    try:
        st = c.predictor.shadow_stats
        assert st is not None
        return c.alarms(_RESTART_MIN), {"alarms": st.alarms, "false": st.false_alarms}
    finally:
        c.stop()


_ALARMS = {(2, 440), (2, 450), (2, 460), (2, 470)}
"""What the collector that never stopped alarms on after minute 420: GPU 2's heat against
its own level (p 0.90) from its first scoring; not GPU 3's second burst (p 0.70), under the
bar its first, false, alarm raised (0.75)."""
_COUNTS = {"alarms": 2, "false": 1}


def test_a_collector_that_never_stopped(tmp_path: Path) -> None:
    alarms, counts = _run(tmp_path, restart=False)
    assert alarms == _ALARMS
    assert counts == _COUNTS


def test_a_restarted_collector_alarms_as_one_that_never_stopped(
        tmp_path: Path, state_backend: dict[str, Any]) -> None:
    """Stopped and started again on the same store (SQLite, then PostgreSQL: the state a
    scale-out replica reads)."""
    alarms, counts = _run(tmp_path, restart=True)
    assert alarms == _ALARMS, (
        f"after the restart: alarms {sorted(alarms)}, the collector that never stopped "
        f"{sorted(_ALARMS)} (GPU 2: a gauge against its own baseline; GPU 3: a raised bar)")
    assert counts == _COUNTS  # the shadow counts went on


def test_a_replica_that_takes_over_alarms_as_the_leader_would_have(
        tmp_path: Path, postgres_server: Any) -> None:
    """Scale-out: replica a leads and learns; its lock session ends (as when it is
    SIGKILLed: no clean stop, no last snapshot); replica b, following on the same
    PostgreSQL, takes over from a's last periodic snapshot and alarms as a collector that
    never stopped."""
    from support.handover import end_leader_session, rows

    dsn = postgres_server.database()
    pg = {"state": "postgresql", "postgres_dsn": dsn}
    a = _Collector(tmp_path / "a", Clock(_T0), **pg)
    b: _Collector | None = None
    try:
        assert poll(lambda: a.ctx.leader.is_leader, interval=0.05)
        b = _Collector(tmp_path / "b", Clock(_T0), **pg)
        for m in range(0, _RESTART_MIN, _BATCH_MIN):
            a.push(m)
        saved = _T0 + _RESTART_MIN * GRID_S  # the grid's end at the last batch's scoring
        assert poll(lambda: rows(dsn, "SELECT time FROM scorer_state") == [(saved,)],
                    interval=0.05)
        end_leader_session(dsn)
        assert poll(lambda: b is not None and b.ctx.leader.is_leader, interval=0.05)
        b.seq, b.clock.t = a.seq, a.clock.t + 5.0
        for m in range(_RESTART_MIN, 480, _BATCH_MIN):
            b.push(m)
        assert b.alarms(_RESTART_MIN) == _ALARMS
        assert b.predictor.snapshots is not None
        assert b.predictor.snapshots.counts["restored"] == 1
        last = _T0 + 480 * GRID_S
        assert poll(lambda: rows(dsn, "SELECT time FROM scorer_state") == [(last,)],
                    interval=0.05)
        # a replica that lost the lead and has not noticed yet writes: its older state
        # does not replace the new leader's
        assert a.predictor.snapshots is not None
        a.predictor.save_state(a.clock.t + 60.0, wait=True)
        assert a.predictor.snapshots.counts["superseded"] == 1
        a.stop()
        assert rows(dsn, "SELECT time FROM scorer_state") == [(last,)]
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_snapshot_that_does_not_fit_leaves_the_scorer_fresh_and_is_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A corrupt snapshot in the store: the collector starts, says why in its log, counts
    it in its metrics, scores from a fresh scorer and replaces the row at its next save
    (one row, never more)."""
    from forewarn.collector.storage.store import Store

    store = Store(tmp_path / "data" / "collector.db")
    with store.write() as tx:
        tx.execute("INSERT INTO scorer_state (name, time, gpus, body) VALUES (?, ?, ?, ?)",
                   ("live_scorer", _T0, 4, b"PK\x03\x04 not an archive"))
    store.close()
    c = _Collector(tmp_path, Clock(_T0))
    try:
        c.push(0)
        assert c.predictor.snapshots is not None
        assert c.predictor.snapshots.counts["refused"] == 1
        assert "snapshot of" in caplog.text and "refused" in caplog.text \
            and "not a readable snapshot" in caplog.text
        assert c.predictor.scorer is not None and c.predictor.scorer.gpus == 4
        assert poll(lambda: c.predictor.snapshots is not None
                    and c.predictor.snapshots.counts["saved"] >= 1, interval=0.01)
        assert c.server.url and 'result="refused"} 1.0' in _metrics(c)
        rows = c.store.query("SELECT time, gpus FROM scorer_state")
        assert rows == [{"time": _T0 + 10 * GRID_S, "gpus": 4}]
    finally:
        c.stop()


def _metrics(c: _Collector) -> str:
    import httpx

    return httpx.get(f"{c.server.url}/metrics", timeout=30).text


def test_a_store_that_cannot_be_read_at_start_delays_the_restore_not_loses_it(
        tmp_path: Path) -> None:
    """The store fails the first read of the snapshot (a database failing over as the
    collector starts): the scorer is restored at the next batch instead, nothing is saved
    over the row meanwhile, and the collector alarms as one that never stopped."""
    c = _Collector(tmp_path, Clock(_T0))
    for m in range(0, _RESTART_MIN, _BATCH_MIN):
        c.push(m)
    c.stop()
    c = _Collector(tmp_path, Clock(c.clock.t + 30.0), seq=c.seq)
    try:
        with c.store.write() as tx:  # the read fails: no such table
            tx.execute("ALTER TABLE scorer_state RENAME TO scorer_state_away")
        c.push(_RESTART_MIN)
        snaps = c.predictor.snapshots
        assert snaps is not None and snaps.counts["failed"] >= 1
        with c.store.write() as tx:
            tx.execute("ALTER TABLE scorer_state_away RENAME TO scorer_state")
        for m in range(_RESTART_MIN + _BATCH_MIN, 480, _BATCH_MIN):
            c.push(m)
        assert snaps.counts["restored"] == 1
        assert c.alarms(_RESTART_MIN) == _ALARMS
    finally:
        c.stop()
