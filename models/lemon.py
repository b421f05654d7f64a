"""Fleet risk ranking ("lemon" GPUs and nodes) from event history alone.

Input: a CSV of events, one row each, columns (documented in docs/models.md):

``gpu_id``  GPU serial or UUID;  ``node``  host name;  ``slot``  position in the node (e.g.
PCI slot or GPU index);  ``first_seen``  when the GPU entered the fleet;  ``event_time``
when the event happened;  ``event_type``  ``xid:<code>``, ``dbe``, ``sbe``, ``remap``,
``off_bus``, ``replaced``... Times are ISO 8601 or seconds since the epoch.

Hard failures (the thing ranked for): ``dbe``, ``off_bus`` and fatal XIDs (48, 64, 74, 79,
95, 119, 120). Everything else is a soft event. Meta's HPCA 2025 study found that removing
lemon nodes cut large-job failures from 14% to 4% (docs/reference.md): a few GPUs and nodes
carry much of the risk.

Method: per GPU, at a cut time, counts of soft and hard events over 7, 30 and 90 days and
in all, days since the last hard failure, age, and hard failures of the other GPUs on the
same node and of the same slot across the fleet. Trained on the fleet's own history
(cut times every ``step_days``, label = a hard failure within the next ``horizon_days``)
with a logistic regression; with too few failures in the history it falls back to fixed
weights (stated in :data:`PRIOR_WEIGHTS`).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from forewarn.models.schema import DataError

__all__ = ["EVENT_COLUMNS", "HARD_EVENTS", "PRIOR_WEIGHTS", "LemonRanker", "read_events",
           "simulate_events"]

EVENT_COLUMNS: Final = ("gpu_id", "node", "slot", "first_seen", "event_time", "event_type")
HARD_EVENTS: Final = frozenset({"dbe", "off_bus", "xid:48", "xid:64", "xid:74", "xid:79",
                                "xid:95", "xid:119", "xid:120"})
DAY: Final = 86400.0
PRIOR_WEIGHTS: Final = {"hard_90": 2.0, "hard_all": 1.0, "soft_7": 0.8, "soft_30": 0.5,
                        "node_hard_30": 0.5, "slot_hard_all": 0.2}
"""Fallback score weights (on log1p counts) when the history has too few failures."""
_FEATURES: Final = ("soft_7", "soft_30", "soft_90", "soft_all", "hard_7", "hard_30",
                    "hard_90", "hard_all", "days_since_hard", "age_days", "node_hard_30",
                    "slot_hard_all")


def _to_seconds(col: pd.Series, name: str) -> pd.Series:
    num = pd.to_numeric(col, errors="coerce")
    if num.notna().all():
        if len(num) and num.median() > 1e11:
            raise DataError(f"events: column {name} looks like milliseconds; expected seconds "
                            "since the epoch or ISO 8601")
        return num.astype(np.float64)
    ts = pd.to_datetime(col, utc=True, errors="coerce")
    if ts.isna().any():
        bad = col[ts.isna()].iloc[0]
        raise DataError(f"events: column {name} has an unreadable time {bad!r}")
    return (ts - pd.Timestamp(0, tz="UTC")).dt.total_seconds()


def read_events(source: str | pd.DataFrame) -> pd.DataFrame:
    """Read and check an events CSV (or frame); times become seconds since the epoch."""
    df = pd.read_csv(source) if isinstance(source, str) else source.copy()
    missing = [c for c in EVENT_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"events: missing column(s) {', '.join(missing)}")
    df["gpu_id"] = df["gpu_id"].astype(str)
    df["node"] = df["node"].astype(str)
    df["slot"] = df["slot"].astype(str)
    df["event_type"] = df["event_type"].astype(str).str.strip().str.lower()
    df["first_seen"] = _to_seconds(df["first_seen"], "first_seen")
    df["event_time"] = _to_seconds(df["event_time"], "event_time")
    df["hard"] = df["event_type"].isin(HARD_EVENTS)
    return df


class LemonRanker:
    """Ranks GPUs by risk of a hard failure in the next ``horizon_days``."""

    def __init__(self, horizon_days: float = 7.0, step_days: float = 7.0,
                 min_failures: int = 8) -> None:
        self.horizon_days = horizon_days
        self.step_days = step_days
        self.min_failures = min_failures
        self.model: Any = None

    def features(self, ev: pd.DataFrame, cut: float) -> pd.DataFrame:
        """One row per GPU known at ``cut``, feature columns as in :data:`_FEATURES`."""
        gpus = ev.groupby("gpu_id").agg(node=("node", "last"), slot=("slot", "last"),
                                        first_seen=("first_seen", "min"))
        gpus = gpus[gpus["first_seen"] <= cut]
        past = ev[ev["event_time"] <= cut]
        age = (cut - past["event_time"]) / DAY
        out = pd.DataFrame(index=gpus.index)
        for kind, mask in (("soft", ~past["hard"]), ("hard", past["hard"])):
            for w in (7, 30, 90):
                sel = past[mask & (age <= w)]
                out[f"{kind}_{w}"] = sel.groupby("gpu_id").size().reindex(out.index).fillna(0)
            out[f"{kind}_all"] = past[mask].groupby("gpu_id").size().reindex(out.index).fillna(0)
        last_hard = past[past["hard"]].groupby("gpu_id")["event_time"].max()
        out["days_since_hard"] = ((cut - last_hard.reindex(out.index)) / DAY).fillna(3650.0)
        out["age_days"] = (cut - gpus["first_seen"]) / DAY
        node_h = past[past["hard"] & (age <= 30)].groupby("node").size()
        out["node_hard_30"] = (gpus["node"].map(node_h).fillna(0) - out["hard_30"]).clip(0)
        slot_h = past[past["hard"]].groupby("slot").size()
        out["slot_hard_all"] = (gpus["slot"].map(slot_h).fillna(0) - out["hard_all"]).clip(0)
        out["node"] = gpus["node"]
        out["slot"] = gpus["slot"]
        return out

    @staticmethod
    def _x(f: pd.DataFrame) -> np.ndarray:
        x = f[list(_FEATURES)].to_numpy(dtype=np.float64)
        out: np.ndarray = np.log1p(np.clip(x, 0, None))
        return out

    def fit(self, ev: pd.DataFrame) -> LemonRanker:
        """Learn from the history in ``ev`` (cut times every ``step_days``)."""
        lo = ev["event_time"].min() + 30 * DAY
        hi = ev["event_time"].max() - self.horizon_days * DAY
        xs, ys = [], []
        for cut in np.arange(lo, hi, self.step_days * DAY):
            f = self.features(ev, float(cut))
            nxt = ev[ev["hard"] & (ev["event_time"] > cut)
                     & (ev["event_time"] <= cut + self.horizon_days * DAY)]
            xs.append(self._x(f))
            ys.append(f.index.isin(nxt["gpu_id"]).astype(int))
        y = np.concatenate(ys) if ys else np.zeros(0, int)
        if y.sum() < self.min_failures or len(set(y)) < 2:
            self.model = None
            return self
        self.model = make_pipeline(StandardScaler(), LogisticRegression(C=0.5, max_iter=500))
        self.model.fit(np.vstack(xs), y)
        return self

    def rank(self, ev: pd.DataFrame, as_of: float | None = None) -> pd.DataFrame:
        """GPUs by risk at ``as_of`` (default: the last event), highest first. Columns:
        ``gpu_id, node, slot, risk`` (probability, or a prior score when unfitted),
        ``method`` and the features."""
        cut = float(ev["event_time"].max() if as_of is None else as_of)
        f = self.features(ev, cut)
        if self.model is not None:
            risk = self.model.predict_proba(self._x(f))[:, 1]
            method = "logistic regression on the fleet's history"
        else:
            risk = sum(w * np.log1p(f[k].to_numpy()) for k, w in PRIOR_WEIGHTS.items())
            method = "prior weights (too few failures in the history to learn from)"
        out = f.assign(risk=risk, method=method).reset_index()
        return out.sort_values("risk", ascending=False, ignore_index=True)

    def node_risk(self, ranked: pd.DataFrame) -> pd.DataFrame:
        """Nodes by risk: P(any of its GPUs fails) when ``risk`` is a probability."""
        r = ranked.assign(q=1 - ranked["risk"].clip(0, 1))
        agg = r.groupby("node")["q"].prod()
        return (1 - agg).rename("risk").sort_values(ascending=False).reset_index()


def simulate_events(*, nodes: int = 64, gpus_per_node: int = 8, days: float = 240.0,
                    lemon_share: float = 0.04, seed: int = 0) -> pd.DataFrame:
    """Event history of a fleet with a few lemon GPUs (hazard x15): for tests and demos.

    Each GPU has a frailty; soft events (XID 63/92/94, remaps, SBEs) and hard failures
    both come at rates proportional to it, so a GPU's past predicts its future.
    """
    rng = np.random.default_rng(seed)
    n = nodes * gpus_per_node
    lemon = rng.random(n) < lemon_share
    frailty = rng.gamma(2.0, 0.5, n) * np.where(lemon, 15.0, 1.0)
    start = 1_735_689_600.0
    rows = []
    soft_types = np.array(["xid:63", "xid:92", "xid:94", "remap", "sbe", "xid:13"])
    hard_types = np.array(["dbe", "off_bus", "xid:79", "xid:48", "xid:119"])
    for g in range(n):
        node, slot = f"node{g // gpus_per_node:04d}", str(g % gpus_per_node)
        n_soft = rng.poisson(frailty[g] * 0.03 * days)
        n_hard = rng.poisson(frailty[g] * 0.003 * days)
        for _ in range(n_soft):
            rows.append((f"GPU-{g:05d}", node, slot, start, start + rng.uniform(0, days) * DAY,
                         str(rng.choice(soft_types))))
        for _ in range(n_hard):
            t = start + rng.uniform(0, days) * DAY
            rows.append((f"GPU-{g:05d}", node, slot, start, t, str(rng.choice(hard_types))))
            # A hard failure is often preceded by soft events in the days before it.
            for _ in range(rng.poisson(2.0)):
                rows.append((f"GPU-{g:05d}", node, slot, start,
                             max(start, t - rng.uniform(0, 5) * DAY), "xid:63"))
        if n_soft + n_hard == 0:
            rows.append((f"GPU-{g:05d}", node, slot, start, start, "xid:13"))
    df = pd.DataFrame(rows, columns=list(EVENT_COLUMNS))
    return df.sort_values("event_time", ignore_index=True)
