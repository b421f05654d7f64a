"""Event-level evaluation of alarms against failures, and the rules-only baseline.

Definitions (also in docs/models.md):

* An **alarm episode** is a run of scored rows of one GPU at or above the threshold, rows
  less than ``merge_gap_s`` apart merged into one.
* An episode is **true** when its GPU fails in ``[start + lead_min_s, end + horizon_s]``;
  otherwise it is a **false alarm**. Precision = true / all episodes.
* A failure is **caught** when a true episode started at least ``lead_min_s`` before it;
  its **lead time** is the failure time minus the earliest such start. Recall is given for
  failures with a precursor (the goal) and for all failures.
* False alarms per 1,000 GPU-days = false episodes / observed GPU-days x 1,000.

The rules-only baseline fires on the error codes themselves -- any hardware XID (memory,
NVLink, bus, GSP classes), an uncorrectable ECC error or an uncorrectable row remap --
as existing GPU health tools do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "RULE_COLUMNS",
    "EvalResult",
    "alarm_episodes",
    "baseline_scores",
    "evaluate_scores",
    "gpu_days",
    "pr_curve",
]


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Figures of one evaluation at one threshold."""

    threshold: float
    episodes: int
    true_episodes: int
    false_episodes: int
    precision: float
    failures: int
    failures_with_precursor: int
    caught: int
    caught_with_precursor: int
    recall: float
    recall_precursor: float
    lead_times_s: tuple[float, ...]
    lead_times_precursor_s: tuple[float, ...]
    gpu_days: float
    false_alarms_per_1000_gpu_days: float

    @property
    def median_lead_precursor_min(self) -> float:
        v = self.lead_times_precursor_s
        return float(np.median(v)) / 60.0 if v else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["median_lead_precursor_min"] = self.median_lead_precursor_min
        d["lead_times_s"] = list(self.lead_times_s)
        d["lead_times_precursor_s"] = list(self.lead_times_precursor_s)
        return d


def gpu_days(scored: pd.DataFrame, step_s: float = 60.0) -> float:
    """Observed GPU-days: scored rows x grid step."""
    return len(scored) * step_s / 86400.0


def alarm_episodes(scored: pd.DataFrame, threshold: float, merge_gap_s: float = 3600.0
                   ) -> pd.DataFrame:
    """Alarm episodes from rows ``node, gpu, time, p``: columns ``node, gpu, start, end``."""
    a = scored.loc[scored["p"] >= threshold, ["node", "gpu", "time"]]
    if a.empty:
        return pd.DataFrame({"node": pd.Series(dtype=str), "gpu": pd.Series(dtype=np.int64),
                             "start": pd.Series(dtype=float), "end": pd.Series(dtype=float)})
    a = a.sort_values(["node", "gpu", "time"], kind="stable")
    same = (a["node"].eq(a["node"].shift())) & (a["gpu"].eq(a["gpu"].shift()))
    new = ~same | (a["time"].diff() > merge_gap_s)
    ep = new.cumsum()
    out = a.groupby(ep).agg(node=("node", "first"), gpu=("gpu", "first"),
                            start=("time", "min"), end=("time", "max"))
    return out.reset_index(drop=True)


def evaluate_scores(scored: pd.DataFrame, labels: pd.DataFrame, threshold: float, *,
                    horizon_s: float, lead_min_s: float = 60.0, merge_gap_s: float = 3600.0,
                    step_s: float = 60.0) -> EvalResult:
    """Judge alarms from ``scored`` (``node, gpu, time, p``) against failure ``labels``."""
    ep = alarm_episodes(scored, threshold, merge_gap_s)
    lab = labels[["node", "gpu", "time", "had_precursor"]].rename(columns={"time": "fail"})
    lab = lab.reset_index(drop=True).assign(fid=lambda d: np.arange(len(d)))
    m = ep.reset_index().merge(lab, on=["node", "gpu"], how="inner")
    ok = (m["fail"] >= m["start"] + lead_min_s) & (m["fail"] <= m["end"] + horizon_s)
    true_idx = set(m.loc[ok, "index"])
    lead = (m.loc[ok].assign(lead=lambda d: d["fail"] - d["start"])
            .groupby("fid")["lead"].max())
    lab = lab.assign(lead=lab["fid"].map(lead))
    caught = lab["lead"].notna()
    pre = lab["had_precursor"].astype(bool)
    days = gpu_days(scored, step_s)
    n_true = len(true_idx)
    n_false = len(ep) - n_true
    return EvalResult(
        threshold=float(threshold), episodes=len(ep), true_episodes=n_true,
        false_episodes=n_false,
        precision=n_true / len(ep) if len(ep) else 1.0,
        failures=len(lab), failures_with_precursor=int(pre.sum()),
        caught=int(caught.sum()), caught_with_precursor=int((caught & pre).sum()),
        recall=float(caught.mean()) if len(lab) else 0.0,
        recall_precursor=float(caught[pre].mean()) if pre.any() else 0.0,
        lead_times_s=tuple(float(x) for x in lab.loc[caught, "lead"]),
        lead_times_precursor_s=tuple(float(x) for x in lab.loc[caught & pre, "lead"]),
        gpu_days=days,
        false_alarms_per_1000_gpu_days=n_false / days * 1000.0 if days else 0.0,
    )


def pr_curve(scored: pd.DataFrame, labels: pd.DataFrame, *, horizon_s: float,
             thresholds: np.ndarray | None = None, **kw: Any) -> pd.DataFrame:
    """Event-level precision and recall (precursor failures) over thresholds."""
    if thresholds is None:
        thresholds = np.unique(np.concatenate([np.linspace(0.02, 0.98, 49),
                                               [0.005, 0.01, 0.99, 0.995]]))
    rows = []
    for t in thresholds:
        r = evaluate_scores(scored, labels, float(t), horizon_s=horizon_s, **kw)
        rows.append({"threshold": t, "precision": r.precision, "recall": r.recall_precursor,
                     "recall_all": r.recall,
                     "false_alarms_per_1000": r.false_alarms_per_1000_gpu_days})
    return pd.DataFrame(rows)


RULE_COLUMNS = ("xid_memory_60", "xid_interconnect_60", "xid_bus_60", "xid_gsp_60",
                "xid_other_60", "remap_u_total")
"""The features the rules fire on (any above zero): hardware XIDs in the hour, an
uncorrectable row remap on record."""


def baseline_scores(features: pd.DataFrame) -> np.ndarray:
    """Rules-only baseline: 1.0 in the hour after a hardware XID, or once an uncorrectable
    ECC error / row remap is on record; else 0.0."""
    hw: np.ndarray = (features[list(RULE_COLUMNS)].to_numpy() > 0).any(axis=1)
    return hw.astype(np.float64)
