"""The collector's cost-aware checkpoint gate inside ``forewarn simulate``.

The collector does not checkpoint on every alarm: its policy weighs each finding with
:func:`forewarn.collector.decide.costmodel.decide_checkpoint` (expected loss = P x work since
the last checkpoint x GPUs against the checkpoint's cost x GPUs) and orders a save only where
the loss is larger. :class:`Gate` runs that same function on each simulated alarm, with the
P the alarm carries and the job's unsaved work at that moment. The GPU count multiplies both
sides, so the job stands as one rank here (a decision's ``gpus`` reads 1).

What P an alarm carries is the detector's figure, drawn per alarm from bands of ``(P,
share)``, one set for alarms a failure follows and one for false alarms. The defaults are
the shipped ``rules_forest``'s, measured on its alarm episodes on four held-out fleets
(``bench/alarm_p.py``: ``heldout_suite(scale=0.25)``, seeds 901-904, 896 GPU-days; P at a
real fleet's failure rate, the highest an episode reached, since the collector weighs a
finding again every 5 minutes while the GPU stays alarmed; 2026-11-24, the model of
s9-thermal): of 5 true episodes, one each reached 0.36, 0.29, 0.0055, 0.0020 and 0.0018.
It raised no false alarm on a healthy GPU there (its one episode that was not a true alarm
began at its GPU's failure minute, with no lead); a false alarm takes the P of the lowest
alarming score, 0.0018 (the model of s7-models: 0.29 twice, 0.005, 0.002 twice; 0.0016).
Those are few episodes of fleets like the training ones (not the leave-one-family-out
folds the recall and false alarms come from): a figure to replace with your fleet's.
"""

from __future__ import annotations

import random

from forewarn.collector.decide.costmodel import (
    CheckpointCostTracker,
    CostDecision,
    decide_checkpoint,
)
from forewarn.collector.decide.policy import PolicySettings
from forewarn.collector.jobs.jobview import JobInfo
from forewarn.wire import Finding, Health, RankSummary, Subject, SuggestedAction

__all__ = ["FALSE_ALARM_P", "REWEIGH_S", "TRUE_ALARM_P", "Gate", "draw_p", "parse_band"]

Bands = tuple[tuple[float, float], ...]

TRUE_ALARM_P: Bands = ((0.36, 0.2), (0.29, 0.2), (0.0055, 0.2), (0.0020, 0.2), (0.0018, 0.2))
"""P carried by alarms a failure follows, ``(P, share)`` (module docstring)."""
FALSE_ALARM_P: Bands = ((0.0018, 1.0),)
"""P carried by false alarms, ``(P, share)`` (module docstring)."""

REWEIGH_S = PolicySettings().dedup_s
"""How often the collector weighs an alarmed GPU's finding again (the scorer reports it at
every scoring; the policy drops repeats within its dedup window): a prediction declined at
first is weighed again this much later, with the work at risk grown since."""

_EPOCH = 1.7e9
"""Simulated seconds are counted from here (the collector's decisions take Unix times)."""


def draw_p(rng: random.Random, bands: Bands) -> float:
    """One alarm's P, drawn from ``bands`` by their shares."""
    return rng.choices([p for p, _ in bands], weights=[w for _, w in bands])[0]


def parse_band(value: str) -> tuple[float, float]:
    """A ``P:SHARE`` string (the command line's) as a band (``P`` alone: share 1); a P
    outside [0, 1] or a share that is not positive is a ValueError."""
    p, sep, share = value.partition(":")
    band = (float(p), float(share) if sep else 1.0)
    if not 0.0 <= band[0] <= 1.0 or not band[1] > 0:
        raise ValueError(f"{value!r}: P must be in [0, 1] and SHARE positive")
    return band


class Gate:
    """The collector's cost model weighing simulated alarms of one job; every decision
    is kept in :attr:`decisions`."""

    def __init__(self, checkpoint_s: float, horizon_s: float = 3600.0) -> None:
        self.checkpoint_s = checkpoint_s
        self.horizon_s = horizon_s
        self.tracker = CheckpointCostTracker(default_s=checkpoint_s)
        self.decisions: list[CostDecision] = []

    def weigh(self, probability: float, work_s: float, now: float) -> bool:
        """Whether the collector orders a checkpoint on an alarm carrying
        ``probability`` at ``now`` (simulated seconds), ``work_s`` after the job's last
        checkpoint."""
        t = _EPOCH + now
        finding = Finding(check="models.failure_predictor", health=Health.DEGRADED,
                          subject=Subject(kind="gpu", node="sim", gpu=0),
                          reason="simulated alarm", action=SuggestedAction.CHECKPOINT,
                          time=t, probability=probability, horizon_s=self.horizon_s)
        rank = RankSummary(job="sim", rank=0, node="sim", gpu=0, pid=1,
                           last_checkpoint_time=t - work_s,
                           checkpoint_seconds=self.checkpoint_s)
        d = decide_checkpoint(finding, JobInfo("sim", (rank,), first_seen=_EPOCH), t,
                              self.tracker)
        self.decisions.append(d)
        return d.act
