"""Job peers: each GPU against the other GPUs of its job at the same minute (Minder's idea,
docs/reference.md, on the live features).

The node-peer features (``<signal>_vs_peers``, :mod:`forewarn.models.features`) compare a
GPU with the other GPUs of its node, so whatever moves the whole node reads zero there: a
node whose eight GPUs all start replaying PCIe packets (its host's root complex, a riser),
or a job that runs one GPU per node. A job's GPUs do the same work on every node, so
:class:`JobPeers` compares each with the other GPUs *of its job*: for every signal of
:data:`~forewarn.models.explain.SIGNALS`, the GPU's change against its own baseline (the
signal's own feature: a counter's excess count, a gauge's ``<g>_vs_own``) is robust-z-scored
across the job's GPUs scored that minute (:func:`~forewarn.models.gauges.peer_robust_z`, the
grouping of the node-peer features, scaled; the floor of the scale is the signal's floor in
``SIGNALS``). Counters count upwards only (fewer errors than the job's median is no fault);
gauges both ways. A whole job that changes together (a new phase, a hotter room) reads zero.

Jobs of fewer than :data:`~forewarn.models.gauges.MIN_ROBUST_PEERS` (3) GPUs are not
compared: with two, the median is their midpoint, so either reads |z| <= 0.67 whichever one
moved -- two GPUs tell that they differ, not which. Their own baselines (the failure
predictor's features) still judge each.

A GPU whose largest z is at least ``z_min`` alarms through an
:class:`~forewarn.models.alarms.AlarmMemory`, the one the failure predictor's alarms use (one
episode per GPU per incident, hysteresis, its bar raised after an alarm no failure followed,
an alarm budget), on the score z / (z + ``z_min``) (0.5 at ``z_min``). Each alarm becomes a
``models.job_peers`` finding (degraded, watch: the policy sends a webhook; the status page
lists it) naming the signals, the GPU's value against the job's median and its node peers'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Final

import numpy as np

from forewarn.models.alarms import AlarmMemory
from forewarn.models.explain import SIGNALS
from forewarn.models.gauges import peer_robust_z
from forewarn.wire import Finding, Health, Subject, SuggestedAction

__all__ = ["JobPeers", "JobScores", "job_scores"]

_COUNTER_SIGNALS: Final = frozenset(name for name, (own, *_rest) in SIGNALS.items()
                                    if not own.endswith("_vs_own"))
"""Signals whose own feature is a counter's excess count (compared upwards only)."""
_THRESHOLD: Final = 0.5


@dataclasses.dataclass(frozen=True)
class JobScores:
    """One minute's comparison of the GPUs (rows) with their job peers: signals x rows."""

    names: list[str]
    z: np.ndarray
    """Robust z against the job's GPUs, signed so that larger is worse."""
    own: np.ndarray
    """The GPU's change against its own baseline."""
    median: np.ndarray
    """The job's median of it."""
    node_peers: np.ndarray
    """The GPU against its node peers (the ``<signal>_vs_peers`` feature)."""
    job: np.ndarray
    """Job code per row (-1: in no job)."""
    jobs: list[str]
    """Job names by code."""

    @functools.cached_property
    def worst(self) -> np.ndarray:
        """Each row's largest z (0 without signals)."""
        top = self.z.max(axis=0) if len(self.z) else np.zeros(len(self.job))
        out: np.ndarray = np.maximum(top, 0.0)
        return out

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """GPUs per job code."""
        out: np.ndarray = np.bincount(self.job[self.job >= 0], minlength=len(self.jobs))
        return out

    def explain(self, j: int, top: int) -> tuple[str, str]:
        """Row ``j``'s strongest signal and the text of its ``top`` signals."""
        order = [k for k in np.argsort(-self.z[:, j], kind="stable")[:top] if self.z[k, j] > 0]
        parts = [f"{self.names[k]} {self.own[k, j]:+.2f} vs own against the job's median "
                 f"{self.median[k, j]:+.2f} ({self.z[k, j]:.1f} robust SD; vs its node peers "
                 f"{self.node_peers[k, j]:+.2f}; {SIGNALS[self.names[k]][2]})" for k in order]
        return (self.names[order[0]] if order else ""), "; ".join(parts)


def job_scores(feats: Mapping[str, np.ndarray], job: np.ndarray, jobs: list[str]
               ) -> JobScores:
    """Compare each row of ``feats`` with the rows of its job (``job``: codes into
    ``jobs``, -1: in no job), for every signal of :data:`~.explain.SIGNALS` present."""
    names = [n for n, (own, peer, *_r) in SIGNALS.items() if own in feats and peer in feats]
    own = {n: np.asarray(feats[SIGNALS[n][0]], np.float64) for n in names}
    z, med = peer_robust_z(own, job, {n: SIGNALS[n][3] for n in names})

    def stack(rows: list[np.ndarray]) -> np.ndarray:
        return np.vstack(rows) if rows else np.zeros((0, len(job)))

    return JobScores(
        names, stack([z[n] if n in _COUNTER_SIGNALS else np.abs(z[n]) for n in names]),
        stack([own[n] for n in names]), stack([med[n] for n in names]),
        stack([np.asarray(feats[SIGNALS[n][1]], np.float64) for n in names]), job, jobs)


class JobPeers:
    """See the module docstring. Keys of the alarm memory are the scorer's GPU slots."""

    name = "models.job_peers"

    def __init__(self, *, z_min: float = 6.0, top: int = 3, memory: AlarmMemory | None = None
                 ) -> None:
        self.z_min = z_min
        self.top = top
        self.memory = memory if memory is not None else AlarmMemory()

    def findings(self, sc: JobScores, keys: np.ndarray, nodes: np.ndarray, gpus: np.ndarray,
                 now: float) -> list[Finding]:
        """The GPUs (rows of ``sc``; ``keys`` their scorer slots) in a job-peer alarm
        episode now, one finding each."""
        self.memory.settle(now)
        if not (sc.job >= 0).any():
            return []
        score = sc.worst / (sc.worst + self.z_min)
        alarm = self.memory.alarming(keys, score, _THRESHOLD, now)
        return [self._finding(sc, j, keys[j].item(), str(nodes[j]), int(gpus[j]), now)
                for j in np.nonzero(alarm)[0].tolist()]

    def _finding(self, sc: JobScores, j: int, key: int, node: str, gpu: int, now: float
                 ) -> Finding:
        episode = self.memory.alarm(key, now)
        signal, text = sc.explain(j, self.top)
        job, size = sc.jobs[int(sc.job[j])], int(sc.sizes[sc.job[j]])
        return Finding(
            check=self.name, health=Health.DEGRADED,
            subject=Subject(kind="gpu", node=node, gpu=gpu, job=job),
            reason=f"GPU {node}/{gpu} stands out from the {size} GPUs of job {job}: {text}",
            action=SuggestedAction.WATCH,
            evidence={"job": job, "job_gpus": size, "signal": signal,
                      "z": round(float(sc.worst[j]), 2), "explanation": text,
                      "episode": f"{node}/{gpu}@{episode.start:.0f}",
                      "bar": round(self.memory.bar(key, _THRESHOLD, now), 4)},
            time=now,
        )
