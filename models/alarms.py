"""Alarms with memory: one episode per GPU per incident, and a bar that remembers.

Every live detector that alarms on a GPU (the failure predictor in
:class:`~forewarn.models.live.LiveScorer`, job peers in :mod:`forewarn.models.job_peers`)
keeps one :class:`AlarmMemory` over a score in [0, 1] and a threshold:

* an open episode (the GPU's last, within ``merge_gap_s``) goes on while the score stays
  at or above ``release`` x the GPU's bar (hysteresis: one episode per incident, not one
  per crossing);
* a new one opens at or above the GPU's own bar: the threshold, raised for every episode
  of this GPU that ended without a failure within ``horizon_s`` in the last ``memory_s``
  (each takes ``1 - bar_step`` of the remaining distance to 1);
* a GPU that already opened ``alarm_budget`` episodes within ``memory_s`` opens no more
  (its alarm budget): counted in :attr:`AlarmMemory.suppressed`.

A failure (:meth:`AlarmMemory.failure`) settles the GPU's episodes: those that began at
least ``lead_min_s`` before it and ended within ``horizon_s`` of it were true.
:class:`ShadowStats` are the predictor's live quality figures from those settlements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

__all__ = ["AlarmMemory", "Episode", "ShadowStats"]


@dataclasses.dataclass
class Episode:
    """One alarm episode of a GPU: first and last scoring that alarmed."""

    start: float
    end: float


@dataclasses.dataclass
class AlarmMemory:
    """Alarm episodes and per-GPU bars (see the module docstring); keys name GPUs."""

    horizon_s: float = 3600.0
    merge_gap_s: float = 3600.0
    lead_min_s: float = 60.0
    release: float = 0.8
    memory_s: float = 7 * 86400.0
    bar_step: float = 0.5
    alarm_budget: int = 3
    episodes: dict[Hashable, list[Episode]] = dataclasses.field(default_factory=dict,
                                                                 init=False)
    suppressed: int = dataclasses.field(default=0, init=False)
    """Scorings where a GPU was at or above the threshold but below its own raised bar or
    over its alarm budget (no alarm)."""
    opened: int = dataclasses.field(default=0, init=False)
    """Episodes opened."""
    _false_at: dict[Hashable, list[float]] = dataclasses.field(default_factory=dict,
                                                                init=False)
    _recent: dict[Hashable, list[float]] = dataclasses.field(default_factory=dict, init=False)

    def bar(self, key: Hashable, threshold: float, now: float) -> float:
        """GPU ``key``'s own bar: ``threshold`` raised by its false episodes."""
        k = sum(1 for t in self._false_at.get(key, ()) if now - t <= self.memory_s)
        return 1.0 - (1.0 - threshold) * self.bar_step ** k

    def alarming(self, keys: np.ndarray, scores: np.ndarray, threshold: float, now: float
                 ) -> np.ndarray:
        """Which of the GPUs ``keys`` alarm now at ``scores`` (aligned)."""
        out = np.zeros(len(keys), bool)
        for j in np.nonzero(scores >= self.release * threshold)[0]:
            key = keys[j].item() if isinstance(keys[j], np.generic) else keys[j]
            bar = self.bar(key, threshold, now)
            eps = self.episodes.get(key, [])
            if eps and now - eps[-1].end <= self.merge_gap_s:
                out[j] = scores[j] >= self.release * bar
            elif scores[j] >= bar:
                recent = self._recent.get(key, [])
                if sum(1 for t in recent if now - t <= self.memory_s) >= self.alarm_budget:
                    self.suppressed += 1
                else:
                    out[j] = True
            elif scores[j] >= threshold:
                self.suppressed += 1
        return out

    def alarm(self, key: Hashable, now: float) -> Episode:
        """GPU ``key`` alarms now: its open episode goes on, or a new one opens."""
        eps = self.episodes.setdefault(key, [])
        if eps and now - eps[-1].end <= self.merge_gap_s:
            eps[-1].end = now
        else:
            eps.append(Episode(now, now))
            self.opened += 1
            recent = [t for t in self._recent.get(key, []) if now - t <= self.memory_s]
            self._recent[key] = [*recent, now]
        return eps[-1]

    def settle(self, now: float) -> int:
        """Close the episodes no failure followed within ``horizon_s`` (each raises its
        GPU's bar); how many."""
        false = 0
        for key, eps in self.episodes.items():
            keep = []
            for ep in eps:
                if now - ep.end > self.horizon_s:
                    false += 1
                    # It alarmed and did not fail: its own bar goes up.
                    self._false_at[key] = [t for t in self._false_at.get(key, [])
                                           if now - t <= self.memory_s] + [now]
                else:
                    keep.append(ep)
            self.episodes[key] = keep
        return false

    def failure(self, key: Hashable, t: float) -> tuple[int, int, float | None]:
        """GPU ``key`` failed at ``t``: (true episodes, false episodes, the longest lead
        of a true one or None); episodes that began after ``t`` stay open."""
        true = false = 0
        best = None
        remaining = []
        for ep in self.episodes.get(key, []):
            if ep.start + self.lead_min_s <= t <= ep.end + self.horizon_s:
                true += 1
                best = max(best or 0.0, t - ep.start)
            elif ep.start <= t:
                false += 1
            else:
                remaining.append(ep)
        self.episodes[key] = remaining
        return true, false, best

    @property
    def open(self) -> int:
        """Episodes not settled."""
        return sum(len(e) for e in self.episodes.values())


@dataclasses.dataclass(frozen=True)
class ShadowStats:
    """Live quality of the predictor, from its own predictions and later failures."""

    alarms: int
    true_alarms: int
    false_alarms: int
    open_alarms: int
    failures: int
    caught: int
    precision: float | None
    recall: float | None
    lead_time_median_s: float | None
    lead_times_s: tuple[float, ...]

    def as_metrics(self) -> dict[str, float]:
        """Gauge values for the collector's exporter (None values left out):
        ``forewarn_model_shadow_{alarms,true_alarms,false_alarms,open_alarms,failures,
        caught}_total`` and ``forewarn_model_shadow_{precision,recall,
        lead_time_median_seconds}``."""
        out = {f"forewarn_model_shadow_{k}_total": float(getattr(self, k))
               for k in ("alarms", "true_alarms", "false_alarms", "open_alarms", "failures",
                         "caught")}
        for k, name in (("precision", "precision"), ("recall", "recall"),
                        ("lead_time_median_s", "lead_time_median_seconds")):
            v = getattr(self, k)
            if v is not None:
                out[f"forewarn_model_shadow_{name}"] = float(v)
        return out
