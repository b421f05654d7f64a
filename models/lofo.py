"""Leave-one-family-out evaluation: train without a behaviour family, judge on it.

A pool of simulated fleets (:func:`family_pool`) is split by GPU into halves. For each
precursor family F, the failure predictor is trained on the first half without the GPUs
that fail by F, and judged on every GPU that fails by F plus the second half's GPUs that
never fail: recall, median lead time and false alarms per 1,000 GPU-days on behaviour it
never saw. For each benign family B, it is trained without the GPUs that show B and judged
on the second half's GPUs that show B and never fail: false alarms only. The same test
sets are scored by the rules-only baseline (:func:`~forewarn.models.evaluate.baseline_scores`),
by an isolation forest fitted per fold on the same training rows and features
(unsupervised: no labels), its cutoff tuned like the model's threshold on a quarter of the
training GPUs, and by the rules with that forest's second opinion
(:mod:`~forewarn.models.rules_forest`, tuned on the same quarter).

Precision is given twice: as simulated (failures inflated) and **at the real base rate**
(Meta: 6.5 failures per 1,000 node-days): expected true alarms per 1,000 GPU-days (recall
x the real rate of failures with a precursor) over those plus the false alarms.

A run takes long (an hour at full scale): :class:`FoldFile` keeps each fold's rows in a
CSV as soon as the fold finishes (appended, flushed and fsynced), and a rerun with the same
file skips the folds it holds.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from forewarn.models.evaluate import EvalResult, baseline_scores, evaluate_scores
from forewarn.models.families import BENIGN, PRECURSORS
from forewarn.models.features import gpu_features
from forewarn.models.fleetsim import FleetParams, load_params, simulate_fleet
from forewarn.models.predictor import label_rows, train_predictor
from forewarn.models.rules_forest import THRESHOLD, train_rules_forest

__all__ = ["DETECTORS", "POOL_SEEDS", "FoldFile", "Pool", "best_detector", "by_family",
           "family_pool", "leave_family_out", "markdown", "pool_fleet_seeds", "summary"]

DETECTORS = ("model", "rules", "isolation_forest", "rules_forest")


@dataclasses.dataclass
class Pool:
    """Features, labels (with ``family``) and benign behaviours of the pooled fleets;
    ``node`` is prefixed with the fleet so GPUs are unique."""

    features: pd.DataFrame
    labels: pd.DataFrame
    behaviours: pd.DataFrame
    real_precursor_per_1000_gpu_days: float

    def keys(self, df: pd.DataFrame) -> pd.Series:
        return df["node"].astype(str) + "/" + df["gpu"].astype(str)


def _real_precursor_rate(p: FleetParams) -> float:
    """Failures with a precursor per 1,000 GPU-days in a real fleet: the real rate times
    the cause mix's share of failures with a precursor."""
    w = np.array([c.weight for c in p.causes])
    share = np.array([c.precursor_share if c.families else 0.0 for c in p.causes])
    return p.real_per_1000_gpu_days * float((w * share).sum() / w.sum())


POOL_SEEDS = range(200)
"""The pool seeds ``--seed`` takes: seed N simulates fleets 301+3N..303+3N, clear of the seeds
the shipped model trains (101, 102), tunes (201) and is judged on (901-905) with."""


def pool_fleet_seeds(seed: int) -> tuple[int, int, int]:
    """The three fleet seeds of pool ``seed`` (:data:`POOL_SEEDS`)."""
    if seed not in POOL_SEEDS:
        raise ValueError(f"pool seed {seed}: must be 0..{POOL_SEEDS[-1]}")
    first = 301 + 3 * seed
    return first, first + 1, first + 2


def family_pool(scale: float = 1.0, base: FleetParams | None = None, seed: int = 0) -> Pool:
    """Simulate pool ``seed``: fleets of ``round(10 * scale)`` nodes x 4 days at 250
    failures per 1,000 GPU-days with families balanced, precursor durations x0.7..1.4 and
    noise x0.8..1.3 across the fleets (:func:`pool_fleet_seeds`)."""
    p = base or load_params()
    nodes = max(1, round(10 * scale))
    feats, labels, beh = [], [], []
    for k, fleet_seed in enumerate(pool_fleet_seeds(seed)):
        q = p.replace(seed=fleet_seed, nodes=nodes, days=4.0, rate_per_1000_gpu_days=250.0,
                      balanced_families=True, precursor_scale=(1.0, 0.7, 1.4)[k % 3],
                      noise_scale=(1.0, 1.3, 0.8)[k % 3])
        d = simulate_fleet(q)
        tag = f"f{fleet_seed}:"
        f = gpu_features(d.samples, d.xids)
        feats.append(f.assign(node=tag + f["node"].astype(str)))
        labels.append(d.labels.assign(node=tag + d.labels["node"].astype(str)))
        beh.append(d.behaviours.assign(node=tag + d.behaviours["node"].astype(str)))
    return Pool(pd.concat(feats, ignore_index=True), pd.concat(labels, ignore_index=True),
                pd.concat(beh, ignore_index=True), _real_precursor_rate(p))


@dataclasses.dataclass(frozen=True)
class _Fold:
    family: str
    kind: str  # "precursor" or "benign"
    train: np.ndarray  # GPU keys
    test: np.ndarray


def _folds(pool: Pool, families: list[str] | None, seed: int) -> list[_Fold]:
    keys = pool.keys(pool.features).unique()
    rng = np.random.default_rng(seed)
    first = set(rng.choice(keys, size=len(keys) // 2, replace=False))
    fail_keys = set(pool.keys(pool.labels))
    lab_key = pool.keys(pool.labels)
    beh_key = pool.keys(pool.behaviours)
    healthy_second = np.array(sorted(set(keys) - first - fail_keys))
    out = []
    for fam in PRECURSORS:
        if families and fam not in families:
            continue
        f_keys = set(lab_key[pool.labels["family"] == fam])
        if not f_keys:
            continue
        train = np.array(sorted(first - f_keys))
        out.append(_Fold(fam, "precursor", train,
                         np.array(sorted(f_keys | set(healthy_second)))))
    for fam in (*BENIGN, "power_cap"):
        if families and fam not in families:
            continue
        b_keys = set(beh_key[pool.behaviours["behaviour"] == fam])
        test = np.array(sorted(b_keys & set(healthy_second)))
        if len(test) == 0:
            continue
        out.append(_Fold(fam, "benign", np.array(sorted(first - b_keys)), test))
    return out


def _row(fold: _Fold, who: str, r: EvalResult, real_rate: float, seed: int
         ) -> dict[str, Any]:
    fa = r.false_alarms_per_1000_gpu_days
    pre = fold.kind == "precursor"
    true_real = r.recall_precursor * real_rate if pre else 0.0
    return {
        "seed": seed, "family": fold.family, "kind": fold.kind, "detector": who,
        "failures": r.failures_with_precursor if pre else 0,
        "caught": r.caught_with_precursor if pre else 0,
        "recall": round(r.recall_precursor, 3) if pre else None,
        "median_lead_min": round(r.median_lead_precursor_min, 1) if pre else None,
        "precision_sim": round(r.precision, 3) if pre else None,
        "precision_real": round(true_real / (true_real + fa), 3) if pre and true_real + fa
        else None,
        "false_alarms_per_1000_gpu_days": round(fa, 2),
        "true_episodes": r.true_episodes, "false_episodes": r.false_episodes,
        "gpu_days": round(r.gpu_days, 1),
        "lead_times_s": list(r.lead_times_precursor_s),
    }


def leave_family_out(pool: Pool, *, families: list[str] | None = None, seed: int = 0,
                     horizon_s: float = 3600.0, target_false_alarms: float = 1.0,
                     max_iter: int = 80, progress: Callable[[str], None] | None = None,
                     skip: Collection[str] = (),
                     on_fold: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """One row per fold and detector (:data:`DETECTORS`): see the module docstring. Folds
    of the families in ``skip`` are left out (done before); ``on_fold`` gets each fold's
    rows as soon as the fold is done."""
    feats, labels = pool.features, pool.labels
    fkey = pool.keys(feats).to_numpy()
    lkey = pool.keys(labels).to_numpy()
    _y, keep = label_rows(feats, labels, horizon_s)
    rows = []
    for fold in _folds(pool, families, seed):
        if fold.family in skip:
            if progress:
                progress(f"{fold.kind} family {fold.family}: done before, skipped")
            continue
        if progress:
            progress(f"{fold.kind} family {fold.family}: train {len(fold.train)} GPUs, "
                     f"test {len(fold.test)}")
        tr = np.isin(fkey, fold.train)
        te = np.isin(fkey, fold.test) & keep
        tr_lab = labels[np.isin(lkey, fold.train)]
        te_lab = labels[np.isin(lkey, fold.test)]
        if fold.kind == "precursor":
            te_lab = te_lab[te_lab["family"] == fold.family]
        model = train_predictor([(feats[tr], tr_lab)], horizon_s=horizon_s,
                                target_false_alarms=target_false_alarms, seed=seed,
                                max_iter=max_iter, neg_stride=10)
        test = feats[te]
        sc = model.score(test)
        rf = train_rules_forest([(feats[tr], tr_lab)], horizon_s=horizon_s,
                                target_false_alarms=target_false_alarms, seed=seed).classifier
        fold_rows = []
        for who, p, thr in (("model", sc["p"].to_numpy(), model.threshold),
                            ("rules", baseline_scores(test), 0.5),
                            ("isolation_forest", rf.forest_alone(test).astype(np.float64), 0.5),
                            ("rules_forest", rf.alarm_score(test), THRESHOLD)):
            r = evaluate_scores(sc.assign(p=p), te_lab, thr, horizon_s=horizon_s)
            fold_rows.append(_row(fold, who, r, pool.real_precursor_per_1000_gpu_days, seed))
        if on_fold:
            on_fold(pd.DataFrame(fold_rows))
        rows += fold_rows
    return pd.DataFrame(rows, columns=_COLUMNS)


_COLUMNS = ("seed", "family", "kind", "detector", "failures", "caught", "recall",
            "median_lead_min", "precision_sim", "precision_real",
            "false_alarms_per_1000_gpu_days", "true_episodes", "false_episodes", "gpu_days",
            "lead_times_s")
"""The columns of :func:`leave_family_out`'s rows (:func:`_row`)."""


class FoldFile:
    """The per-fold results CSV at ``path``: the rows of :func:`leave_family_out` plus
    ``scale`` (the pool's, so a rerun on another pool does not mix them in), lead times as
    space-separated seconds. Rows are appended fold by fold, flushed and fsynced: a run cut
    off keeps every fold it finished."""

    def __init__(self, path: str | Path, scale: float) -> None:
        self.path = Path(path)
        self.scale = scale

    def read(self) -> pd.DataFrame:
        """The rows held (none: an empty frame). Raises ``ValueError`` when they are of a
        pool of another scale or lack a column."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return pd.DataFrame(columns=_COLUMNS)
        df = pd.read_csv(self.path, keep_default_na=True)
        if "scale" not in df.columns or not np.allclose(df["scale"], self.scale):
            raise ValueError(f"{self.path}: holds folds of another pool (column scale, "
                             f"not {self.scale:g}): give another --out")
        missing = [c for c in _COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(f"{self.path}: written by an older forewarn (no column "
                             f"{', '.join(missing)}): give another --out")
        leads = df["lead_times_s"].fillna("").astype(str)
        df["lead_times_s"] = [[float(x) for x in v.split()] for v in leads]
        df = df.astype(object).where(df.notna(), None)
        return df.drop(columns="scale")

    def append(self, rows: pd.DataFrame) -> None:
        """Add one fold's rows."""
        out = rows.assign(lead_times_s=[" ".join(f"{x:g}" for x in v)
                                        for v in rows["lead_times_s"]], scale=self.scale)
        header = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", encoding="utf-8", newline="") as f:
            out.to_csv(f, header=header, index=False)
            f.flush()
            os.fsync(f.fileno())


def summary(res: pd.DataFrame, real_rate: float) -> pd.DataFrame:
    """Per detector over all folds (of every seed): recall and median lead over the
    precursor folds' failures, false alarms per 1,000 GPU-days as the mean over all folds,
    precision at the real base rate from those two."""
    out = []
    for who, d in res.groupby("detector", sort=False):
        pre = d[d["kind"] == "precursor"]
        fails, caught = int(pre["failures"].sum()), int(pre["caught"].sum())
        leads = [x for v in pre["lead_times_s"] for x in v]
        recall = caught / fails if fails else 0.0
        fa = float(d["false_alarms_per_1000_gpu_days"].mean())
        true_real = recall * real_rate
        pooled = by_family(pre, real_rate)
        worst = pooled.sort_values("recall").iloc[0] if len(pooled) else None
        out.append({
            "detector": who, "failures": fails, "caught": caught,
            "recall": round(recall, 3),
            "median_lead_min": round(float(np.median(leads)) / 60, 1) if leads else 0.0,
            "false_alarms_per_1000_gpu_days": round(fa, 2),
            "precision_real": round(true_real / (true_real + fa), 3) if true_real + fa
            else 0.0,
            "worst_family": f"{worst['family']} ({worst['recall']:.2f})"
            if worst is not None else "",
        })
    return pd.DataFrame(out)


def _cell(v: Any, fmt: str) -> str:
    return "–" if v is None or (isinstance(v, float) and np.isnan(v)) else format(v, fmt)


def by_family(res: pd.DataFrame, real_rate: float) -> pd.DataFrame:
    """The folds of every seed pooled per family and detector: failures, caught and
    episodes summed, lead times joined, false alarms per 1,000 GPU-days over the summed
    GPU-days, precision at the real rate from the pooled recall and false alarms (one
    seed: its rows as they are)."""
    if res["seed"].nunique() <= 1:
        return res
    out = []
    for (fam, kind, who), d in res.groupby(["family", "kind", "detector"], sort=False):
        pre = kind == "precursor"
        fails, caught = int(d["failures"].sum()), int(d["caught"].sum())
        true, false = int(d["true_episodes"].sum()), int(d["false_episodes"].sum())
        leads = [x for v in d["lead_times_s"] for x in v]
        days = float(d["gpu_days"].sum())
        fa = round(false / days * 1000, 2) if days else 0.0
        true_real = caught / fails * real_rate if pre and fails else 0.0
        out.append({
            "seed": None, "family": fam, "kind": kind, "detector": who, "failures": fails,
            "caught": caught, "recall": round(caught / fails, 3) if pre and fails else None,
            "median_lead_min": round(float(np.median(leads)) / 60, 1) if pre and leads
            else (0.0 if pre else None),
            "precision_sim": round(true / (true + false), 3) if pre and true + false
            else (1.0 if pre else None),
            "precision_real": round(true_real / (true_real + fa), 3) if true_real + fa
            else None,
            "false_alarms_per_1000_gpu_days": fa,
            "true_episodes": true, "false_episodes": false, "gpu_days": round(days, 1),
            "lead_times_s": leads})
    return pd.DataFrame(out, columns=_COLUMNS)


def markdown(res: pd.DataFrame, real_rate: float) -> str:
    """The per-family table (seeds pooled: :func:`by_family`) and the summary (with one line
    per seed and detector when there are several) as Markdown."""
    lines = ["| family | kind | detector | failures | recall | median lead (min) "
             "| precision (sim) | precision (real rate) | false alarms / 1000 GPU-days |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in by_family(res, real_rate).itertuples(index=False):
        lines.append(
            f"| {r.family} | {r.kind} | {r.detector} | {r.failures or '–'} | "
            f"{_cell(r.recall, '.2f')} | {_cell(r.median_lead_min, '.1f')} | "
            f"{_cell(r.precision_sim, '.2f')} | {_cell(r.precision_real, '.2f')} | "
            f"{r.false_alarms_per_1000_gpu_days:.2f} |")
    seeds = sorted(set(res["seed"]))
    parts = [("", summary(res, real_rate))]
    if len(seeds) > 1:
        parts += [(f" (seed {k})", summary(res[res["seed"] == k], real_rate)) for k in seeds]
    lines += ["", "| over all folds | failures (caught) | recall | median lead (min) "
              "| false alarms / 1000 GPU-days (mean) | precision (real rate) | worst family |",
              "|---|---|---|---|---|---|---|"]
    for tag, s in parts:
        for r in s.itertuples(index=False):
            lines.append(f"| **{r.detector}**{tag} | {r.failures} ({r.caught}) | "
                         f"{r.recall:.2f} | {r.median_lead_min:.1f} | "
                         f"{r.false_alarms_per_1000_gpu_days:.2f} | {r.precision_real:.2f} | "
                         f"{r.worst_family} |")
    return "\n".join(lines) + "\n"


def best_detector(res: pd.DataFrame, real_rate: float) -> str:
    """The detector with the highest real-rate precision x recall over all folds."""
    s = summary(res, real_rate)
    score = s["recall"] * s["precision_real"]
    return str(s.loc[score.idxmax(), "detector"])

