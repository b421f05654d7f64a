"""Live scoring for the collector: feed samples as they arrive, score every few seconds,
and score the predictions against what later happened (shadow scoring).

:class:`LiveScorer` keeps, per GPU, the same cumulative grid state as
:func:`forewarn.models.features.grid_state` and a ring of the last hour of per-minute
snapshots, all in numpy arrays, so :meth:`LiveScorer.score` computes the feature vectors
of every GPU at once with :func:`forewarn.models.features.derive` -- the same numbers as
the batch features a model was trained on -- and runs the predictor on them.

Shadow scoring: every alarm (probability at or above the model's threshold) opens or
extends an episode; a failure seen later (fatal XID, GPU lost / reset required, a new
uncorrectable ECC error or row remap) settles it. :meth:`LiveScorer.shadow` returns live
precision, recall and lead times, which the collector exports as metrics.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Final

import numpy as np

from forewarn.gpu import FATAL_XIDS
from forewarn.models.alarms import AlarmMemory, ShadowStats
from forewarn.models.explain import SIGNALS, explain
from forewarn.models.features import (
    ACTIVE,
    BASELINE_BLOCK,
    CUM_COLUMNS,
    GRID_S,
    LAGS,
    LAST_COLUMNS,
    PEER_MINUTES,
    baseline_end,
    derive,
    xid_class,
)
from forewarn.models.job_peers import JobPeers, JobScores, job_scores
from forewarn.models.live_fold import COLS as _COLS
from forewarn.models.live_fold import IX as _IX
from forewarn.models.live_fold import N_CUM as _N_CUM
from forewarn.models.live_fold import fold_sample
from forewarn.models.live_scores import MinuteScores, feature_matrix
from forewarn.models.oscillation import HISTORY_COLUMNS
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import Finding, GpuSample, GpuState, XidEvent

__all__ = ["LiveScorer"]

_SIGNAL_FEATURES: Final = frozenset(f for own, peer, *_ in SIGNALS.values() for f in (own, peer))
"""The features an alarm's explanation reads."""
_RING: Final = max(LAGS) + 1
_MAX_JUMP: Final = 7 * 24 * 60  # minutes
_BACKLOG: Final = 24 * 60
"""Minutes the grid may stay behind the wall clock waiting for data (the bus stream keeps
a day of batches by default, ``bus_stream_max_age_s``): a longer silence is rolled on by
the wall clock, so that the samples after it are not taken for a clock far ahead."""


def _named(rows: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The rows of a column-wise state block, by column name."""
    return {c: rows[j] for j, c in enumerate(names)}


class LiveScorer:
    """Incremental features and failure probabilities for a fleet of GPUs.

    Args:
        model: the predictor (e.g. :func:`forewarn.models.persist.load_default_model`).
        stale_s: GPUs with no sample for this long are not scored (failed or gone).
        merge_gap_s: alarms closer than this on one GPU form one episode.
        lead_min_s: a failure counts as caught only if the alarm came this much earlier.

    Contract: samples of one GPU arrive in time order; :meth:`score` is called with a
    time at or after the samples it should see. The per-minute grid follows the samples'
    clock: a scoring reads the wall clock's last complete minute only as far as the data
    reached it, so samples that arrive after a scoring but belong before it (a backlog)
    fill their own minutes; only a sample of a minute already snapshotted is late (counted
    into the open minute: :attr:`late`). Nothing here raises on bad samples: missing
    fields count as not supported.
    """

    def __init__(self, model: FailurePredictor, *, stale_s: float = 180.0,
                 merge_gap_s: float = 3600.0, lead_min_s: float = 60.0,
                 capacity: int = 256, release: float = 0.8, memory_s: float = 7 * 86400.0,
                 bar_step: float = 0.5, alarm_budget: int = 3) -> None:
        self.model = model
        self.stale_s = stale_s
        def memory() -> AlarmMemory:
            return AlarmMemory(horizon_s=model.horizon_s, merge_gap_s=merge_gap_s,
                               lead_min_s=lead_min_s, release=release, memory_s=memory_s,
                               bar_step=bar_step, alarm_budget=alarm_budget)

        self.memory = memory()
        """The predictor's alarm episodes and per-GPU bars (GPU slots as keys)."""
        self.peers = JobPeers(memory=memory())
        """Job peers (:meth:`job_findings`), with an alarm memory of their own alike."""
        self._jobs: dict[int, tuple[str, float]] = {}
        """GPU slot -> (the job it runs, when a rank said so)."""
        self._jobs_changed = 0
        self._job_scores: tuple[MinuteScores, int, np.ndarray, JobScores] | None = None
        self.job_stale_s = 600.0
        self._index: dict[tuple[str, int], int] = {}
        self._nodes: list[str] = []
        self._gpus: list[int] = []
        self._node_ids: list[int] = []
        self._node_index: dict[str, int] = {}
        # State is laid out column by column (the GPU slot is the last axis): scoring
        # reads whole columns, and the features' arithmetic runs on contiguous arrays.
        self._cur = np.zeros((len(_COLS), capacity))
        self._ring = np.zeros((_RING, _N_CUM, capacity))
        self._first = np.zeros((_N_CUM, capacity))
        self._first_minute = np.full(capacity, -1, np.int64)
        # State at the last two BASELINE_BLOCK boundaries: the own baseline's end row.
        self._block = np.zeros((2, _N_CUM, capacity))
        self._block_minute = np.full(2, -1, np.int64)
        self._last_seen = np.full(capacity, -np.inf)
        # LAST_COLUMNS as they stood at the end of the last snapshotted minute, as the
        # batch grid has them (not the open minute's newer values).
        self._last = np.zeros((len(LAST_COLUMNS), capacity))
        self._scores: MinuteScores | None = None
        self._minute: int | None = None  # last minute snapshotted
        self._wall: int | None = None  # the minute of the last scoring's ``now``
        self._held: list[tuple[int, int, GpuSample]] = []  # ahead of _wall: a heap
        self._arrivals = itertools.count()
        self._true = self._false = 0
        self._failures = self._caught = 0
        self._leads: list[float] = []
        self._last_failure: dict[int, float] = {}
        self.skipped = 0
        """Samples refused (time far ahead of the others)."""
        self.late = 0
        """Samples that arrived after their minute was snapshotted (counted in the next)."""
        self.repeated = 0
        """Samples refused as not newer than their GPU's last (read again after a restore)."""

    # -- ingest -----------------------------------------------------------------------
    def _slot(self, node: str, gpu: int) -> int:
        key = (node, gpu)
        i = self._index.get(key)
        if i is None:
            i = len(self._nodes)
            if i >= self._cur.shape[1]:
                self._grow()
            self._index[key] = i
            self._nodes.append(node)
            self._node_ids.append(self._node_index.setdefault(node, len(self._node_index)))
            self._gpus.append(gpu)
        return i

    def _grow(self) -> None:
        cap = self._cur.shape[1] * 2
        self._cur, self._ring, self._first, self._block, self._last = (
            np.concatenate([a, np.zeros_like(a)], axis=-1)
            for a in (self._cur, self._ring, self._first, self._block, self._last))
        self._first_minute = np.concatenate([self._first_minute,
                                             np.full(cap // 2, -1, np.int64)])
        self._last_seen = np.concatenate([self._last_seen, np.full(cap // 2, -np.inf)])

    def observe(self, s: GpuSample) -> None:
        """Take one sample (in time order per GPU; else refused: :attr:`repeated`). One of a
        minute past the last scoring's is held until a scoring reaches it: one agent's
        clock ahead must not roll the grid for every GPU."""
        minute = int(s.time // GRID_S)
        if self._wall is not None and minute > self._wall:
            if minute - self._wall > _MAX_JUMP:
                self.skipped += 1
            else:
                heapq.heappush(self._held, (minute, next(self._arrivals), s))
            return
        i = self._index.get((s.node, s.gpu))
        if i is not None and s.time <= self._last_seen[i]:
            self.repeated += 1
            return
        if not self._advance(minute):
            return
        i = self._slot(s.node, s.gpu)
        if s.state != GpuState.OK:
            self._failure(i, s.time)
        started = bool(self._first_minute[i] >= 0)
        if fold_sample(self._cur[:, i], s, started):
            self._failure(i, s.time)
        if not started:
            self._first_minute[i] = minute
        self._last_seen[i] = s.time

    def _advance(self, minute: int) -> bool:
        """Snapshot the minutes before ``minute`` if it opens a new one; False for a
        sample to refuse (a clock far ahead would wipe the ring)."""
        if self._minute is not None and minute - self._minute > _MAX_JUMP:
            self.skipped += 1
            return False
        if self._minute is not None and minute <= self._minute:
            self.late += 1  # counted into the open minute, not lost
        else:
            self._roll(minute - 1)
        return True

    def observe_xid(self, x: XidEvent) -> None:
        """Take one XID event (``gpu`` None: ignored for per-GPU features)."""
        if x.gpu is None:
            return
        i = self._slot(x.node, x.gpu)
        self._cur[_IX[f"xid_{xid_class(x.code)}"], i] += 1
        if x.code in FATAL_XIDS:
            self._failure(i, x.time)

    # -- grid -------------------------------------------------------------------------
    def _roll(self, upto: int) -> None:
        """Snapshot the current state for every minute up to ``upto`` (inclusive)."""
        if self._minute is None:
            self._minute = upto
            return
        n = len(self._nodes)
        while self._minute < upto:
            m = self._minute + 1
            prev = self._ring[(m - 1) % _RING, :, :n]
            snap = self._cur[:_N_CUM, :n]
            started = (self._first_minute[:n] >= 0) & (self._first_minute[:n] <= m)
            fresh = self._first_minute[:n] == m
            for c in ACTIVE:
                inc = (snap[_IX[c]] > prev[_IX[c]]) & started & ~fresh
                snap[_IX[f"{c}_active"]] += inc
            self._ring[m % _RING, :, :n] = snap
            self._first[:, :n][:, fresh] = snap[:, fresh]
            if m % BASELINE_BLOCK == 0:
                self._block[0] = self._block[1]
                self._block[1, :, :n] = snap
                self._block_minute[:] = (self._block_minute[1], m)
            self._minute = m
            self._last[:, :n] = self._cur[_N_CUM:, :n]
            if upto - m > _RING:  # no sample comes in between: the minutes after are m's
                self._repeat(m, upto - _RING)

    def _repeat(self, m: int, to: int) -> None:
        """The minutes after ``m`` up to ``to`` as copies of minute ``m``, at once: what
        rolling them one by one gives when no sample came since (a long silence), the
        last of them in the ring and the baseline blocks' boundaries among them."""
        n = len(self._nodes)
        snap = self._ring[m % _RING, :, :n]
        first = -(-(m + 1) // BASELINE_BLOCK) * BASELINE_BLOCK
        for b in range(first, to + 1, BASELINE_BLOCK)[-2:]:
            self._block[0] = self._block[1]
            self._block[1, :, :n] = snap
            self._block_minute[:] = (self._block_minute[1], b)
        self._ring[to % _RING, :, :n] = snap
        self._minute = to

    # -- scoring ----------------------------------------------------------------------
    def features(self, now: float) -> tuple[np.ndarray, dict[str, np.ndarray], float]:
        """(GPU slots, feature columns, feature time) for the GPUs fresh at ``now``."""
        m = self._complete(now)
        live = self._candidates(m, now)
        feats = self._derive(m, live)
        fresh = self._fresh(live, now)
        return live[fresh], {k: v[fresh] for k, v in feats.items()}, (m + 1) * GRID_S

    def _complete(self, now: float) -> int:
        """The minute to score at ``now``: the wall clock's last complete minute, but never
        past the newest minute a sample reached: a backlog read after a scoring (a paused
        or new leader, agents replaying their spool) fills its own minutes, not one. Held
        samples (:meth:`observe`) whose minute ``now`` reached are taken first. Whether a
        GPU is scored stays on the wall clock (:meth:`_fresh`); a silence longer than
        :data:`_BACKLOG` is rolled on by the wall clock."""
        self._wall = int(now // GRID_S)
        while self._held and self._held[0][0] <= self._wall:
            self.observe(heapq.heappop(self._held)[2])
        wall = self._wall - 1
        if self._minute is None:
            return wall
        top = float(self._last_seen[:len(self._nodes)].max(initial=-np.inf))
        newest = int(top // GRID_S) if np.isfinite(top) else self._minute
        self._roll(max(min(wall, newest), wall - _BACKLOG))
        return self._minute

    def _candidates(self, m: int, now: float) -> np.ndarray:
        """GPU slots that may count as a peer at minute ``m`` (a sample within
        PEER_MINUTES of it, or of ``now`` when that is earlier: derive decides exactly,
        from the grid, as the batch features do), and the GPUs fresh at ``now``."""
        n = len(self._nodes)
        started = (self._first_minute[:n] >= 0) & (self._first_minute[:n] <= m)
        seen = min(now, (m + 1) * GRID_S) - self._last_seen[:n]
        window = max(PEER_MINUTES * GRID_S + 2 * GRID_S, self.stale_s)
        live: np.ndarray = np.nonzero(started & (seen <= window))[0]
        return live

    def _fresh(self, slots: np.ndarray, now: float) -> np.ndarray:
        """Which of ``slots`` sent a sample within :attr:`stale_s` (scored)."""
        fresh: np.ndarray = now - self._last_seen[slots] <= self.stale_s
        return fresh

    def _derive(self, m: int, live: np.ndarray) -> dict[str, np.ndarray]:
        """Feature columns of the GPU slots ``live`` (ascending) at the end of minute
        ``m``."""
        # All slots (the usual case): views, no copies.
        at: slice | np.ndarray = slice(0, len(live)) \
            if len(live) == 0 or live[-1] == len(live) - 1 else live
        now = _named(self._ring[m % _RING][:, at], CUM_COLUMNS)
        now |= _named(self._last[:, at], LAST_COLUMNS)
        first_minute = self._first_minute[at]
        first = self._first[:, at]
        lag = {k: _named(np.where((m - k) < first_minute, first,
                                  self._ring[(m - k) % _RING][:, at]), CUM_COLUMNS)
               for k in LAGS}
        e = int(baseline_end(np.array(m)))
        held = np.nonzero(self._block_minute == e)[0]
        minutes = np.maximum(e - first_minute, 0).astype(np.float64)
        if len(held) == 0:  # not running then: no baseline yet
            minutes[:] = 0.0
        end = _named(self._block[held[0] if len(held) else 0][:, at], CUM_COLUMNS)
        group = np.unique(np.asarray(self._node_ids, np.int64)[live], return_inverse=True)[1]
        rows = [_IX[c] for c in HISTORY_COLUMNS]
        def history(k: int) -> dict[str, np.ndarray]:  # the ring k minutes back, as lag
            back = self._ring[(m - k) % _RING][rows][:, at]
            return _named(np.where((m - k) < first_minute, first[rows], back), HISTORY_COLUMNS)
        return derive(now, lag, _named(first, CUM_COLUMNS), end, minutes, group, history)

    def _scored(self, now: float) -> tuple[MinuteScores, np.ndarray]:
        """The minute's scores and the positions in them of the GPUs fresh at ``now``.

        Features change only when the grid moves to the next minute, so one minute's
        features and probabilities are computed once and reused by the scorings after it
        in that minute (the collector scores every few seconds); computed again when the
        model changed or a fresh GPU is not among them. The scores :meth:`prepare`
        computed for ``now`` are used even when a sample of a new minute arrived between
        its parts (the scoring keeps the minute it began with)."""
        c = self._scores
        got = self._reusable(c.minute, now) if c is not None and c.at == now else None
        if got is None:
            m = self._complete(now)
            got = self._reusable(m, now)
            if got is None:
                live = self._candidates(m, now)
                for _ in self._compute(m, live, len(live), now):
                    pass
                got = self._reusable(m, now)
                assert got is not None  # the fresh GPUs are among the candidates
        return got

    def _reusable(self, m: int, now: float) -> tuple[MinuteScores, np.ndarray] | None:
        """The computed scores and the positions in them of the GPUs fresh at ``now``, when
        they are minute ``m``'s, of this model, and hold every such GPU."""
        c = self._scores
        if c is None or c.minute != m or c.model is not self.model:
            return None
        live = self._candidates(m, now)
        pos = c.positions(live[self._fresh(live, now)])
        return None if pos is None else (c, pos)

    @property
    def computed(self) -> MinuteScores | None:
        """The last features and probabilities computed (one minute's; see :meth:`_scored`)."""
        return self._scores

    def prepare(self, now: float, chunk: int) -> Iterator[None]:
        """:meth:`score`'s features and probabilities at ``now`` in parts, a ``yield``
        between them: every GPU's features at once (one consistent minute), then the
        probabilities ``chunk`` GPUs at a time. :meth:`score` at ``now`` uses them (unless
        a GPU turned fresh meanwhile: then it computes them again, whole)."""
        m = self._complete(now)
        if self._reusable(m, now) is None:
            yield from self._compute(m, self._candidates(m, now), chunk, now)

    def _compute(self, m: int, live: np.ndarray, chunk: int, now: float) -> Iterator[None]:
        """The features and probabilities of the GPU slots ``live`` at minute ``m`` for the
        scoring at ``now``, a ``yield`` before each ``chunk`` of probabilities; kept as
        :attr:`computed`."""
        model, feats = self.model, self._derive(m, live)
        x = feature_matrix(feats, model)  # a copy: later samples do not change this scoring
        probs = np.zeros(len(live))
        for a in range(0, len(live), max(chunk, 1)):
            yield
            probs[a:a + chunk] = model.predict_proba(x[a:a + chunk])
        self._scores = MinuteScores(m, now, model, live, feats, probs, x)

    def score(self, now: float) -> list[Finding]:
        """Findings for the GPUs in an alarm episode (:meth:`alarming`), each with its
        episode and an explanation (:func:`forewarn.models.explain.explain`) in its
        evidence."""
        c, pos = self._scored(now)
        if len(pos) == 0:
            return []
        live, probs = c.slots[pos], c.probs[pos]
        nodes = np.asarray(self._nodes, dtype=object)[live]
        gpus = np.asarray(self._gpus)[live]
        self._settle(now)
        alarm = self.alarming(live, probs, now)
        rows = np.nonzero(alarm)[0]
        for i in live[rows]:
            self._alarm(int(i), now)
        evidence: dict[str, np.ndarray] = {}
        if len(rows):
            feats = {k: v[pos] for k, v in c.feats.items() if k in _SIGNAL_FEATURES}
            for k, v in explain(feats, rows).items():
                col = np.full(len(live), None, dtype=object)
                col[rows] = v
                evidence[k] = col
            col = np.full(len(live), None, dtype=object)
            col[rows] = [f"{nodes[j]}/{gpus[j]}@"
                         f"{self.memory.episodes[int(live[j])][-1].start:.0f}" for j in rows]
            evidence["episode"] = col
            bar = np.full(len(live), np.nan)
            bar[rows] = [self.bar(int(live[j]), now) for j in rows]
            evidence["bar"] = bar
        return self.model.findings(nodes, gpus, probs, now, evidence, alarm=alarm)

    def assign_job(self, node: str, gpu: int, job: str, t: float) -> None:
        """A rank of ``job`` runs on ``node`` GPU ``gpu`` (a rank summary at ``t``)."""
        i = self._slot(node, gpu)
        if self._jobs.get(i, ("",))[0] != job:
            self._jobs_changed += 1
        self._jobs[i] = (job, t)

    def job_findings(self, now: float) -> list[Finding]:
        """Findings for the GPUs in a job-peer alarm episode (:mod:`.job_peers`): each GPU
        against the other GPUs of its job (a rank summary within :attr:`job_stale_s`)."""
        if not self._jobs:
            return []
        c, pos = self._scored(now)
        live = c.slots[pos]
        return self.peers.findings(self._compared(c, pos, now), live,
                                   np.asarray(self._nodes, dtype=object)[live],
                                   np.asarray(self._gpus)[live], now)

    def _compared(self, c: MinuteScores, pos: np.ndarray, now: float) -> JobScores:
        """The job-peer comparison of the minute's GPUs ``pos``: computed once a minute, as
        the features, and again when the job map changed or another set of GPUs is fresh."""
        got = self._job_scores
        if got is not None and got[0] is c and got[1] == self._jobs_changed \
                and np.array_equal(got[2], pos):
            return got[3]
        codes: dict[str, int] = {}
        job = np.full(len(pos), -1, np.int64)
        for j, i in enumerate(c.slots[pos].tolist()):
            seen = self._jobs.get(i)
            if seen is not None and now - seen[1] <= self.job_stale_s:
                job[j] = codes.setdefault(seen[0], len(codes))
        sc = job_scores({k: v[pos] for k, v in c.feats.items() if k in _SIGNAL_FEATURES},
                        job, list(codes))
        self._job_scores = (c, self._jobs_changed, pos, sc)
        return sc

    # -- alarms with memory -------------------------------------------------------------
    @property
    def suppressed(self) -> int:
        """Scorings where a GPU was at or above the model's threshold but below its own
        raised bar or over its alarm budget (no finding)."""
        return self.memory.suppressed

    def bar(self, i: int, now: float) -> float:
        """GPU slot ``i``'s own alarm bar (:meth:`AlarmMemory.bar`)."""
        return self.memory.bar(i, self.model.threshold, now)

    def alarming(self, live: np.ndarray, probs: np.ndarray, now: float) -> np.ndarray:
        """Which of the ``live`` GPU slots alarm now (:meth:`AlarmMemory.alarming`)."""
        self.memory.horizon_s = self.model.horizon_s
        return self.memory.alarming(live, probs, self.model.threshold, now)

    # -- shadow scoring ---------------------------------------------------------------
    def _alarm(self, i: int, now: float) -> None:
        self.memory.alarm(i, now)

    def _failure(self, i: int, t: float) -> None:
        last = self._last_failure.get(i)
        if last is not None and t - last < self.model.horizon_s:
            return
        self._last_failure[i] = t
        self._failures += 1
        self.peers.memory.failure(i, t)
        true, false, best = self.memory.failure(i, t)
        self._true += true
        self._false += false
        if best is not None:
            self._caught += 1
            self._leads.append(best)

    def _settle(self, now: float) -> None:
        self._false += self.memory.settle(now)

    def shadow(self) -> ShadowStats:
        """Live precision (settled alarms), recall and lead times so far."""
        settled = self._true + self._false
        leads = tuple(self._leads)
        return ShadowStats(
            alarms=self.memory.opened, true_alarms=self._true, false_alarms=self._false,
            open_alarms=self.memory.open,
            failures=self._failures, caught=self._caught,
            precision=self._true / settled if settled else None,
            recall=self._caught / self._failures if self._failures else None,
            lead_time_median_s=float(np.median(leads)) if leads else None,
            lead_times_s=leads,
        )

    @property
    def gpus(self) -> int:
        """GPUs seen so far."""
        return len(self._nodes)

