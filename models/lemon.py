"""Fleet risk ranking ("lemon" GPUs and nodes) as survival analysis over in-service time.

Input: a CSV of events, one row each (documented in docs/models.md):

``gpu_id``  GPU serial or UUID;  ``event_time``  ISO 8601 or seconds since the epoch;
``event_type``  a life event (``install``, ``move``, ``remove``, ``retire``), a hard
failure (``dbe``, ``off_bus``, fatal XIDs 48, 64, 74, 79, 95, 119, 120 as ``xid:<code>``)
or any other soft event (``xid:63``, ``sbe``, ``remap``...);  ``location``  for
``install`` and ``move``: a path of any depth, e.g. ``row3/rack12/chassis1/node0/slot5``;
``cohort`` (optional)  batch, serial prefix or install month, on any of the GPU's rows.

A GPU is at risk from an ``install`` until the next ``remove`` or ``retire`` (a ``move``
changes its location and keeps it at risk); a failure does not by itself end service.

Method: a discrete-time hazard model. Rows are GPU-periods: at each cut time t (every
``step_days`` back from the as-of time, the last ``max_cuts`` of them), every GPU in
service, labelled 1 when it fails within ``horizon_days`` after t. Covariates at t use only
events up to t: in-service age (log, an infant-mortality term, and time since the current
install), recency-weighted prior hard failures and soft events (exponential decay, 30,
180 and 730 days), removals, and *shrunken* effects of every level of the location path and
of the cohort. A level's effect is an empirical-Bayes gamma-Poisson estimate of its failure
rate ratio (observed over expected failures, expected = exposure x fleet rate), shrunk
toward its parent's estimate with a prior strength fitted to that level by marginal
likelihood, and computed without the GPU's own failures and exposure. A regularised
logistic regression (scikit-learn) on these covariates gives the hazard of the next
``horizon_days``. With too few failures in the history it ranks by
:data:`PRIOR_WEIGHTS`.

``as_of`` uses nothing after it: events later than the as-of time are dropped first.
Meta's HPCA 2025 study found that removing lemon nodes cut large-job failures from 14% to
4% (docs/reference.md): a few GPUs and nodes carry much of the risk.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pandas as pd
from scipy.special import gammaln  # type: ignore[import-untyped]
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from forewarn.gpu import FATAL_XIDS
from forewarn.models.schema import DataError

__all__ = ["DAY", "EVENT_COLUMNS", "HARD_EVENTS", "LIFE_EVENTS", "PRIOR_WEIGHTS", "SEP",
           "FleetHistory", "LemonRanker", "read_events", "stints", "training_cuts"]

EVENT_COLUMNS: Final = ("gpu_id", "event_time", "event_type")
"""Required columns; ``location`` and ``cohort`` are optional."""
LIFE_EVENTS: Final = frozenset({"install", "move", "remove", "retire"})
HARD_EVENTS: Final = frozenset({"dbe", "off_bus", *(f"xid:{c}" for c in FATAL_XIDS)})
DAY: Final = 86400.0
SEP: Final = "/"
PRIOR_WEIGHTS: Final = {"hard_r180": 2.0, "hard_r730": 1.0, "soft_r30": 0.5,
                        "infant": 0.5}
"""Fallback score weights when the history has too few failures to learn from."""
_TAUS: Final = (30, 180, 730)
_OWN: Final = tuple(f"hard_r{t}" for t in _TAUS) + tuple(f"soft_r{t}" for t in _TAUS) + (
    "log_age", "infant", "log_stint", "stint_infant", "removals")
_PRIOR_GRID: Final = np.logspace(-1.0, 3.0, 33)


def _to_seconds(col: pd.Series, name: str) -> pd.Series:
    num = pd.to_numeric(col, errors="coerce")
    if num.notna().all():
        if len(num) and num.median() > 1e11:
            raise DataError(f"events: column {name} looks like milliseconds; expected seconds "
                            "since the epoch or ISO 8601")
        return num.astype(np.float64)
    ts = pd.to_datetime(col, utc=True, errors="coerce", format="mixed")
    if ts.isna().any():
        bad = col[ts.isna()].iloc[0]
        raise DataError(f"events: column {name} has an unreadable time {bad!r}")
    return (ts - pd.Timestamp(0, tz="UTC")).dt.total_seconds()


def _text(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df.columns:
        return pd.Series("", index=df.index, dtype=object)
    return df[col].fillna("").astype(str).str.strip()


def read_events(source: str | pd.DataFrame) -> pd.DataFrame:
    """Read and check an events CSV (or frame); times become seconds since the epoch.

    Raises :class:`~forewarn.models.schema.DataError` naming the column and the first bad
    row: a missing column, an unreadable time, an ``install``/``move`` without location.
    """
    df = pd.read_csv(source, dtype={"location": str, "cohort": str}) \
        if isinstance(source, str) else source.copy()
    missing = [c for c in EVENT_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"events: missing column(s) {', '.join(missing)}")
    out = pd.DataFrame({
        "gpu_id": df["gpu_id"].astype(str),
        "event_time": _to_seconds(df["event_time"], "event_time"),
        "event_type": df["event_type"].astype(str).str.strip().str.lower(),
        "location": _text(df, "location").str.strip(SEP),
        "cohort": _text(df, "cohort"),
    })
    placed = out["event_type"].isin(["install", "move"])
    bad = placed & (out["location"] == "")
    if bad.any():
        i = int(np.argmax(bad.to_numpy()))
        raise DataError(f"events: row {i}: column location is empty for "
                        f"{out['event_type'].iloc[i]} of GPU {out['gpu_id'].iloc[i]}")
    out["hard"] = out["event_type"].isin(HARD_EVENTS)
    out["soft"] = ~out["hard"] & ~out["event_type"].isin(LIFE_EVENTS)
    return out.sort_values(["gpu_id", "event_time"], kind="stable", ignore_index=True)


def stints(ev: pd.DataFrame) -> pd.DataFrame:
    """Periods in service: ``gpu_id, start, end`` (inf while in service), ``location``,
    ``cohort`` (the GPU's first non-empty cohort)."""
    life = ev[ev["event_type"].isin(LIFE_EVENTS)]
    end = life.groupby("gpu_id")["event_time"].shift(-1).fillna(np.inf)
    placed = life["event_type"].isin(["install", "move"]).to_numpy()
    st = pd.DataFrame({"gpu_id": life["gpu_id"].to_numpy()[placed],
                       "start": life["event_time"].to_numpy()[placed],
                       "end": end.to_numpy()[placed],
                       "location": life["location"].to_numpy()[placed]})
    named = ev[ev["cohort"] != ""].groupby("gpu_id")["cohort"].first()
    st["cohort"] = st["gpu_id"].map(named).fillna("")
    return st


def location_depth(st: pd.DataFrame) -> int:
    """The deepest location path in the stints."""
    return int(st["location"].str.count(SEP).max() + 1) if len(st) else 1


def _prior_strength(obs: np.ndarray, mean: np.ndarray) -> float:
    """Gamma prior shape for Poisson counts ``obs`` with means ``mean``: the value on a
    grid with the highest negative-binomial marginal likelihood (empirical Bayes)."""
    keep = mean > 0
    o, m = obs[keep][:, None], mean[keep][:, None]
    a = _PRIOR_GRID[None, :]
    ll = gammaln(o + a) - gammaln(a) + a * np.log(a / (a + m)) + o * np.log(m / (a + m))
    return float(_PRIOR_GRID[int(np.argmax(ll.sum(axis=0)))])


class FleetHistory:
    """A fleet's events and stints as integer-coded arrays, for covariates at any time.

    Location levels and cohort are coded once (``levels``: one code array per stint per
    level, deepest last; the cohort is the last "level", under the fleet alone) so each
    cut's counts are ``np.bincount`` calls.
    """

    def __init__(self, ev: pd.DataFrame) -> None:
        self.ev = ev
        self.st = stints(ev)
        self.depth = location_depth(self.st)
        self.gpu_ids, g = np.unique(np.concatenate([ev["gpu_id"].to_numpy(str),
                                                    self.st["gpu_id"].to_numpy(str)]),
                                    return_inverse=True)
        self.ev_g = g[:len(ev)]
        self.st_g = g[len(ev):]
        self.start = self.st["start"].to_numpy()
        self.end = self.st["end"].to_numpy()
        self.time = ev["event_time"].to_numpy()
        parts = self.st["location"].str.split(SEP)
        self.levels: list[np.ndarray] = []
        self.parent: list[np.ndarray | None] = []
        prev: np.ndarray | None = None
        for d in range(self.depth):
            # A shorter path repeats its full self at the deeper levels.
            codes = pd.factorize(parts.map(lambda p, n=d + 1: SEP.join(p[:n])))[0]
            self.levels.append(codes)
            self.parent.append(None if prev is None else _parents(codes, prev))
            prev = codes
        self.cohort, self.cohort_names = pd.factorize(self.st["cohort"])
        self.no_cohort = np.asarray(self.cohort_names == "")
        hard = ev["hard"].to_numpy()
        self.fail_g, self.fail_t = self.ev_g[hard], self.time[hard]
        self.fail_stint = self._stint_at(self.fail_g, self.fail_t)
        self.soft = ev["soft"].to_numpy()
        self.removed = (ev["event_type"] == "remove").to_numpy()

    def _stint_at(self, g: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Index of the stint of GPU ``g`` that holds time ``t`` (-1: out of service)."""
        order = np.lexsort((self.start, self.st_g))
        t0 = min(self.start.min(initial=0.0), t.min(initial=0.0))
        # One sorted key per (GPU, start): 1e10 s (317 years) per GPU keeps it exact.
        key = self.st_g[order] * 1e10 + (self.start[order] - t0)
        pos = np.searchsorted(key, g * 1e10 + (t - t0), side="right") - 1
        ok = pos >= 0
        idx = np.where(ok, order[np.maximum(pos, 0)], -1)
        ok &= (self.st_g[np.maximum(idx, 0)] == g) & (t <= self.end[np.maximum(idx, 0)])
        out: np.ndarray = np.where(ok, idx, -1)
        return out

    def covariates(self, t: float) -> pd.DataFrame:
        """Covariates at time ``t`` of every GPU in service then (events up to ``t``).

        Columns: ``location``, ``cohort``, ``age_days``, ``hard_all`` (prior hard
        failures), the model's own-history terms (``hard_r30``... ``removals``),
        ``loc1..loc<depth>`` and ``cohort_effect`` (shrunken log rate ratios)."""
        n = len(self.gpu_ids)
        x = np.clip(np.minimum(self.end, t) - self.start, 0.0, None) / DAY
        cur = np.nonzero((self.start <= t) & (self.end > t))[0]
        cur = cur[np.unique(self.st_g[cur], return_index=True)[1]]
        g = self.st_g[cur]
        age = np.bincount(self.st_g, weights=x, minlength=n)[g]
        stint = (t - self.start[cur]) / DAY
        f = pd.DataFrame({"location": self.st["location"].to_numpy()[cur],
                          "cohort": self.st["cohort"].to_numpy()[cur], "age_days": age},
                         index=pd.Index(self.gpu_ids[g], name="gpu_id"))
        past = self.time <= t
        f["hard_all"] = np.bincount(self.ev_g[past & self.ev["hard"].to_numpy()],
                                    minlength=n)[g]
        for kind, mask in (("hard", self.ev["hard"].to_numpy()), ("soft", self.soft)):
            sel = past & mask
            age_ev = (t - self.time[sel]) / DAY
            for tau in _TAUS:
                s = np.bincount(self.ev_g[sel], weights=np.exp(-age_ev / tau), minlength=n)
                f[f"{kind}_r{tau}"] = np.log1p(s[g])  # heavy-tailed: a lemon's hundreds
        f["log_age"] = np.log1p(age)
        f["infant"] = np.exp(-age / 30.0)
        f["log_stint"] = np.log1p(stint)
        f["stint_infant"] = np.exp(-stint / 30.0)
        f["removals"] = np.log1p(np.bincount(self.ev_g[past & self.removed], minlength=n)[g])
        for name, eff in self._effects(t, x, cur).items():
            f[name] = eff
        return f

    def _effects(self, t: float, x: np.ndarray, cur: np.ndarray) -> dict[str, np.ndarray]:
        """Shrunken log rate ratios of each current GPU's groups, its own failures and
        exposure left out: every location level toward its parent, the cohort toward
        the fleet."""
        fs = self.fail_stint[(self.fail_t <= t) & (self.fail_stint >= 0)]
        rate = len(fs) / max(x.sum(), 1e-9)
        out: dict[str, np.ndarray] = {}
        theta_cur = np.ones(len(cur))
        theta_grp: np.ndarray | None = None
        for d, codes in enumerate(self.levels):
            par = self.parent[d]
            prior = np.ones(codes.max() + 1) if par is None or theta_grp is None \
                else theta_grp[par]
            theta_grp, theta_cur = self._level(codes, prior, theta_cur, rate, fs, x, cur)
            out[f"loc{d + 1}"] = np.log(theta_cur)
        _g, coh = self._level(self.cohort, np.ones(len(self.cohort_names)), np.ones(len(cur)),
                              rate, fs, x, cur)
        out["cohort_effect"] = np.where(self.no_cohort[self.cohort[cur]], 0.0, np.log(coh))
        return out

    def _level(self, codes: np.ndarray, prior: np.ndarray, theta_parent: np.ndarray,
               rate: float, fs: np.ndarray, x: np.ndarray, cur: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """(each group's shrunken rate ratio, each current GPU's leave-own-out one)."""
        k = codes.max() + 1
        o = np.bincount(codes[fs], minlength=k).astype(np.float64)
        e = np.bincount(codes, weights=x, minlength=k) * rate
        a = _prior_strength(o, e * prior)
        grp = (o + a * prior) / (a + e)
        # The GPU's own failures and exposure in its current group are left out.
        n = len(self.gpu_ids)
        here = np.full(n, -1)
        here[self.st_g[cur]] = codes[cur]
        own_f = fs[codes[fs] == here[self.st_g[fs]]]
        own_o = np.bincount(self.st_g[own_f], minlength=n)[self.st_g[cur]]
        mine = codes == here[self.st_g]
        own_x = np.bincount(self.st_g[mine], weights=x[mine], minlength=n)[self.st_g[cur]]
        c = codes[cur]
        oo = np.maximum(o[c] - own_o, 0.0)
        ee = np.maximum(e[c] - own_x * rate, 0.0)
        return grp, (oo + a * theta_parent) / (a + ee)

    def failed_within(self, idx: pd.Index, t: float, horizon_days: float) -> np.ndarray:
        """1 for each GPU in ``idx`` with a hard failure in (t, t + horizon]."""
        sel = (self.fail_t > t) & (self.fail_t <= t + horizon_days * DAY)
        out: np.ndarray = idx.isin(self.gpu_ids[self.fail_g[sel]]).astype(np.int64)
        return out


def _parents(child: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Parent code of each child code."""
    out = np.zeros(child.max() + 1, np.int64)
    out[child] = parent
    return out


def training_cuts(ev: pd.DataFrame, as_of: float, horizon_days: float, step_days: float,
                  max_cuts: int) -> list[float]:
    """Cut times whose horizon ends by ``as_of``, newest first, after 90 days of history."""
    lo = float(ev["event_time"].min()) + 90 * DAY
    cuts: list[float] = []
    t = as_of - horizon_days * DAY
    while t >= lo and len(cuts) < max_cuts:
        cuts.append(t)
        t -= step_days * DAY
    return cuts


class LemonRanker:
    """Ranks GPUs in service by risk of a hard failure in the next ``horizon_days``."""

    def __init__(self, horizon_days: float = 90.0, step_days: float | None = None,
                 max_cuts: int = 12, min_failures: int = 20, c: float = 1.0) -> None:
        self.horizon_days = horizon_days
        self.step_days = step_days if step_days is not None else max(horizon_days / 2, 7.0)
        self.max_cuts = max_cuts
        self.min_failures = min_failures
        self.c = c
        self.model: Any = None
        self.features: tuple[str, ...] = ()
        self.as_of = 0.0
        self.history: FleetHistory | None = None
        self.rows: list[tuple[float, pd.DataFrame, np.ndarray]] = []
        """The GPU-period rows fitted on: (cut, covariates, failed within the horizon)."""

    def fit(self, ev: pd.DataFrame, as_of: float | None = None) -> LemonRanker:
        """Learn from the history up to ``as_of`` (default: the last event); nothing
        later is read."""
        self.as_of = float(ev["event_time"].max() if as_of is None else as_of)
        h = self.history = FleetHistory(ev[ev["event_time"] <= self.as_of])
        self.features = _OWN + tuple(f"loc{d + 1}" for d in range(h.depth)) \
            + ("cohort_effect",)
        self.rows = []
        for t in training_cuts(h.ev, self.as_of, self.horizon_days, self.step_days,
                               self.max_cuts):
            f = h.covariates(t)
            self.rows.append((t, f, h.failed_within(f.index, t, self.horizon_days)))
        y = np.concatenate([r[2] for r in self.rows]) if self.rows else np.zeros(0, np.int64)
        self.model = None
        if y.sum() >= self.min_failures and y.sum() < len(y):
            self.model = make_pipeline(StandardScaler(),
                                       LogisticRegression(C=self.c, max_iter=1000))
            self.model.fit(np.vstack([r[1][list(self.features)].to_numpy(np.float64)
                                      for r in self.rows]), y)
        return self

    def rank(self) -> pd.DataFrame:
        """GPUs in service at the as-of time, highest risk first. Columns: ``gpu_id,
        location, cohort, risk`` (probability of a hard failure within the horizon, or a
        prior score when unfitted), ``method`` and the covariates."""
        if self.history is None:
            raise RuntimeError("LemonRanker.rank before fit")
        f = self.history.covariates(self.as_of)
        if self.model is not None:
            risk = self.model.predict_proba(f[list(self.features)].to_numpy(np.float64))[:, 1]
            method = "discrete-time hazard (logistic) with shrunken location/cohort effects"
        else:
            risk = sum(w * f[k].to_numpy() for k, w in PRIOR_WEIGHTS.items())
            method = "prior weights (too few failures in the history to learn from)"
        out = f.assign(risk=risk, method=method).rename_axis("gpu_id").reset_index()
        return out.sort_values(["risk", "gpu_id"], ascending=[False, True],
                               ignore_index=True)

    @staticmethod
    def node_risk(ranked: pd.DataFrame) -> pd.DataFrame:
        """Nodes (the location path less its last part) by P(any of its GPUs fails) when
        ``risk`` is a probability."""
        node = ranked["location"].str.rsplit(SEP, n=1).str[0]
        q = (1 - ranked["risk"].clip(0, 1)).groupby(node.rename("node")).prod()
        return (1 - q).rename("risk").sort_values(ascending=False).reset_index()
