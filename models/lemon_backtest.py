"""Rolling-cut backtest of the lemon ranking against built-in baselines.

At each cut time T (every ``every_days`` after ``warmup_days`` of history, while T plus the
horizon is inside the history) every method is fitted on the events up to T only, ranks
the GPUs in service at T, and is judged on which of them have a hard failure within
``horizon_days`` after T: ROC AUC, precision at k (the top ``top_share`` of GPUs in
service) and lift (precision at k over the base rate).

Baselines (each sees the same history):

- ``prior failures``: the GPU's count of hard failures so far;
- ``age``: the fleet's empirical hazard by in-service age (quarter-year bins);
- ``location hazard``: the raw failure rate (failures per exposure day, the GPU's own
  left out) of the GPU's node, the location path less its last part;
- ``logistic regression``: L2-regularised, on log age, log prior failures, and one-hot
  cohort and every location level, trained on the same GPU-period rows as the ranker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import pandas as pd
from scipy.sparse import csr_matrix, hstack  # type: ignore[import-untyped]
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from forewarn.models.lemon import DAY, SEP, FleetHistory, LemonRanker

__all__ = ["METHODS", "SHIPPED", "backtest", "markdown"]

SHIPPED: Final = "survival (shipped)"
METHODS: Final = (SHIPPED, "prior failures", "age", "location hazard", "logistic regression")

Scorer = Callable[[pd.DataFrame, LemonRanker], np.ndarray]
"""A baseline: (covariates of the GPUs at the cut, the ranker fitted at the cut, whose
history and GPU-period rows it may reuse) -> scores."""


def _prior_failures(f: pd.DataFrame, r: LemonRanker) -> np.ndarray:
    out: np.ndarray = f["hard_all"].to_numpy(np.float64)
    return out


def _age(f: pd.DataFrame, r: LemonRanker) -> np.ndarray:
    bins = np.arange(0.0, 20 * 365.0, 91.0)
    fails, expo = np.zeros(len(bins)), np.zeros(len(bins))
    for _t, g, y in r.rows:
        b = np.digitize(g["age_days"], bins) - 1
        np.add.at(fails, b, y)
        np.add.at(expo, b, 1.0)
    hazard = (fails + 0.5) / (expo + 1.0)
    out: np.ndarray = hazard[np.digitize(f["age_days"], bins) - 1]
    return out


def _history(r: LemonRanker) -> FleetHistory:
    if r.history is None:
        raise RuntimeError("baseline before the ranker was fitted")
    return r.history


def _location_hazard(f: pd.DataFrame, r: LemonRanker) -> np.ndarray:
    h = _history(r)
    ev, st, t = h.ev, h.st, r.as_of
    x = (np.minimum(st["end"], t) - st["start"]) / DAY
    node = st["location"].str.rsplit(SEP, n=1).str[0]
    hard = ev[ev["hard"]]
    at = pd.merge_asof(hard[["gpu_id", "event_time"]].sort_values("event_time"),
                       st.assign(node=node)[["gpu_id", "start", "node"]].sort_values("start"),
                       left_on="event_time", right_on="start", by="gpu_id").dropna()
    o = at.groupby("node").size()
    own_o = at.groupby(["node", "gpu_id"]).size()
    xs = x.groupby(node).sum()
    own_x = x.groupby([node, st["gpu_id"]]).sum()
    cur = f["location"].str.rsplit(SEP, n=1).str[0]
    pairs = pd.MultiIndex.from_arrays([cur.to_numpy(), f.index.to_numpy()])
    num = cur.map(o).fillna(0).to_numpy() - own_o.reindex(pairs).fillna(0).to_numpy()
    den = cur.map(xs).fillna(0).to_numpy() - own_x.reindex(pairs).fillna(0).to_numpy()
    out: np.ndarray = np.where(den > 0, num / np.maximum(den, 1e-9), 0.0)
    return out


def _design(f: pd.DataFrame, enc: OneHotEncoder, scale: StandardScaler, depth: int
            ) -> csr_matrix:
    num = np.column_stack([np.log1p(f["age_days"]), np.log1p(f["hard_all"])])
    cats = _categories(f, depth)
    return hstack([csr_matrix(scale.transform(num)), enc.transform(cats)]).tocsr()


def _categories(f: pd.DataFrame, depth: int) -> pd.DataFrame:
    parts = f["location"].str.split(SEP)
    cols = {f"L{d}": parts.map(lambda p, n=d + 1: SEP.join(p[:n])) for d in range(depth)}
    return pd.DataFrame(cols | {"cohort": f["cohort"]}, index=f.index)


def _logistic(f: pd.DataFrame, r: LemonRanker) -> np.ndarray:
    if not r.rows:
        return np.zeros(len(f))
    depth = _history(r).depth
    train = pd.concat([g for _t, g, _y in r.rows])
    y = np.concatenate([y for _t, _g, y in r.rows])
    enc = OneHotEncoder(handle_unknown="ignore").fit(_categories(train, depth))
    num = np.column_stack([np.log1p(train["age_days"]), np.log1p(train["hard_all"])])
    scale = StandardScaler().fit(num)
    m = LogisticRegression(C=1.0, max_iter=1000).fit(_design(train, enc, scale, depth), y)
    out: np.ndarray = m.predict_proba(_design(f, enc, scale, depth))[:, 1]
    return out


_BASELINES: Final[dict[str, Scorer]] = {
    "prior failures": _prior_failures, "age": _age, "location hazard": _location_hazard,
    "logistic regression": _logistic}


def backtest(ev: pd.DataFrame, *, horizon_days: float = 90.0, every_days: float = 182.5,
             warmup_days: float = 365.0, top_share: float = 0.01) -> pd.DataFrame:
    """One row per cut and method: ``cut`` (epoch s), ``method``, ``gpus`` (in service),
    ``failures`` (of them, within the horizon), ``auc``, ``precision_at_k``, ``k``,
    ``lift``."""
    t0, t_end = float(ev["event_time"].min()), float(ev["event_time"].max())
    out = []
    cut = t0 + warmup_days * DAY
    while cut + horizon_days * DAY <= t_end:
        ranker = LemonRanker(horizon_days=horizon_days).fit(ev, as_of=cut)
        ranked = ranker.rank().set_index("gpu_id")
        y = ranked.index.isin(ev.loc[ev["hard"] & (ev["event_time"] > cut)
                                     & (ev["event_time"] <= cut + horizon_days * DAY),
                                     "gpu_id"]).astype(np.int64)
        scores = {SHIPPED: ranked["risk"].to_numpy()}
        for name, fn in _BASELINES.items():
            scores[name] = fn(ranked, ranker)
        k = max(10, round(top_share * len(y)))
        for name in METHODS:
            out.append(_judge(cut, name, scores[name], y, k))
        cut += every_days * DAY
    return pd.DataFrame(out)


def _judge(cut: float, name: str, s: np.ndarray, y: np.ndarray, k: int) -> dict[str, object]:
    auc = float(roc_auc_score(y, s)) if 0 < y.sum() < len(y) else float("nan")
    # Ties are broken at random (seeded) so a constant score is not flattered by order.
    tie = np.random.default_rng(0).random(len(s))
    top = np.lexsort((tie, -s))[:k]
    prec = float(y[top].mean())
    base = float(y.mean())
    return {"cut": cut, "method": name, "gpus": len(y), "failures": int(y.sum()), "auc": auc,
            "precision_at_k": prec, "k": k, "lift": prec / base if base else float("nan")}


def markdown(res: pd.DataFrame) -> str:
    """The backtest as a Markdown table (one row per cut, AUC and precision@k per method),
    a mean row, and how many cuts the shipped method beats each baseline on AUC."""
    auc = res.pivot(index="cut", columns="method", values="auc")[list(METHODS)]
    pk = res.pivot(index="cut", columns="method", values="precision_at_k")[list(METHODS)]
    meta = res.groupby("cut")[["gpus", "failures", "k"]].first()
    head = "| cut | GPUs | failures | " + " | ".join(f"AUC {m}" for m in METHODS) \
        + " | " + " | ".join(f"P@k {m}" for m in METHODS) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(METHODS))]
    for cut in auc.index:
        day = pd.Timestamp(cut, unit="s").date().isoformat()
        m = meta.loc[cut]
        lines.append(f"| {day} | {int(m['gpus'])} | {int(m['failures'])} | "
                     + " | ".join(f"{v:.3f}" for v in auc.loc[cut]) + " | "
                     + " | ".join(f"{v:.3f}" for v in pk.loc[cut]) + " |")
    lines.append("| **mean** | | | " + " | ".join(f"**{v:.3f}**" for v in auc.mean()) + " | "
                 + " | ".join(f"**{v:.3f}**" for v in pk.mean()) + " |")
    lift = res.groupby("method")["lift"].mean()[list(METHODS)]
    wins = [f"{m}: {int((auc[SHIPPED] > auc[m]).sum())} of {len(auc)}" for m in METHODS[1:]]
    return "\n".join(lines) + "\n\nMean lift at k: " + ", ".join(
        f"{m} {v:.1f}" for m, v in lift.items()) + ".\nCuts where the shipped method's AUC " \
        "beats the baseline's: " + "; ".join(wins) + ".\n"
