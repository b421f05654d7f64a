"""Evaluation report: figures, the rules-only baseline, and two PNGs (matplotlib Agg).

:func:`evaluate_model` scores held-out fleets with a model and the baseline and returns
the figures; :func:`write_report` writes ``report.json``, ``report.md``,
``pr_curve.png`` (event-level precision vs recall of failures with a precursor, model
and baseline) and ``lead_times.png`` (lead-time histogram of caught failures).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from forewarn.models.evaluate import EvalResult, baseline_scores, evaluate_scores, pr_curve
from forewarn.models.predictor import FailurePredictor, label_rows

__all__ = ["evaluate_model", "write_report"]


def _fmt(r: EvalResult) -> dict[str, Any]:
    return {
        "precision": round(r.precision, 3), "recall_precursor": round(r.recall_precursor, 3),
        "recall_all": round(r.recall, 3),
        "median_lead_precursor_min": round(r.median_lead_precursor_min, 1),
        "false_alarms_per_1000_gpu_days": round(r.false_alarms_per_1000_gpu_days, 2),
        "failures": r.failures, "failures_with_precursor": r.failures_with_precursor,
        "caught_with_precursor": r.caught_with_precursor, "episodes": r.episodes,
        "false_episodes": r.false_episodes, "gpu_days": round(r.gpu_days, 1),
    }


def evaluate_model(model: FailurePredictor,
                   sets: Iterable[tuple[str, pd.DataFrame, pd.DataFrame]]) -> dict[str, Any]:
    """Score each named (features, labels) set with the model and the baseline."""
    scored_all, base_all, labels_all = [], [], []
    per_set: dict[str, Any] = {}
    h = model.horizon_s
    for name, feats, labels in sets:
        _y, keep = label_rows(feats, labels, h)
        f = feats.loc[keep]
        sc = model.score(f)
        bs = sc.assign(p=baseline_scores(f))
        per_set[name] = {"model": _fmt(evaluate_scores(sc, labels, model.threshold,
                                                       horizon_s=h)),
                         "baseline": _fmt(evaluate_scores(bs, labels, 0.5, horizon_s=h))}
        tag = name + ":"
        scored_all.append(sc.assign(node=tag + sc["node"].astype(str)))
        base_all.append(bs.assign(node=tag + bs["node"].astype(str)))
        labels_all.append(labels.assign(node=tag + labels["node"].astype(str)))
    scored = pd.concat(scored_all, ignore_index=True)
    base = pd.concat(base_all, ignore_index=True)
    labels = pd.concat(labels_all, ignore_index=True)
    overall = evaluate_scores(scored, labels, model.threshold, horizon_s=h)
    base_r = evaluate_scores(base, labels, 0.5, horizon_s=h)
    curve = pr_curve(scored, labels, horizon_s=h)
    return {
        "threshold": model.threshold, "horizon_s": h,
        "overall": {"model": _fmt(overall), "baseline": _fmt(base_r)},
        "sets": per_set,
        "lead_times_precursor_s": list(overall.lead_times_precursor_s),
        "baseline_lead_times_precursor_s": list(base_r.lead_times_precursor_s),
        "pr_curve": curve.to_dict(orient="list"),
        "goals": {
            "recall_precursor>=0.9": overall.recall_precursor >= 0.9,
            "median_lead>=10min": overall.median_lead_precursor_min >= 10.0,
            "precision>=0.9": overall.precision >= 0.9,
            "false_alarms<=1/1000gpu_days": overall.false_alarms_per_1000_gpu_days <= 1.0,
        },
        "model_metadata": model.metadata,
    }


def _plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = pd.DataFrame(report["pr_curve"])
    base = report["overall"]["baseline"]
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=100)
    ax.plot(curve["recall"], curve["precision"], marker="o", markersize=5, linewidth=3,
            label="forewarn model")
    ax.scatter([base["recall_precursor"]], [base["precision"]], color="red", zorder=3,
               label="rules-only baseline (error codes)")
    m = report["overall"]["model"]
    ax.scatter([m["recall_precursor"]], [m["precision"]], color="black", marker="x",
               zorder=3, label=f"operating point (threshold {report['threshold']:.2f})")
    ax.set_xlabel("recall (failures with a precursor)")
    ax.set_ylabel("precision (alarm episodes)")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_title("Event-level precision-recall, held-out fleets")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pr_curve.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=100)
    leads = np.asarray(report["lead_times_precursor_s"]) / 60.0
    bl = np.asarray(report["baseline_lead_times_precursor_s"]) / 60.0
    top = max(10.0, float(max(leads.max() if len(leads) else 0, bl.max() if len(bl) else 0)))
    bins = [float(b) for b in np.linspace(0, top, 25)]
    ax.hist(leads, bins=bins, alpha=0.7, label=f"model (n={len(leads)})")
    ax.hist(bl, bins=bins, alpha=0.5, color="red", label=f"baseline (n={len(bl)})")
    ax.axvline(10, color="black", linestyle="--", label="10 min goal")
    ax.set_xlabel("lead time before failure (minutes)")
    ax.set_ylabel("failures caught")
    ax.set_title("Lead time of caught failures (with precursor)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lead_times.png")
    plt.close(fig)


def _markdown(report: dict[str, Any]) -> str:
    lines = ["| set | who | precision | recall (precursor) | recall (all) | median lead (min) "
             "| false alarms / 1000 GPU-days | failures (with precursor) | GPU-days |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = [("**all held-out**", report["overall"]), *list(report["sets"].items())]
    for name, d in rows:
        for who in ("model", "baseline"):
            r = d[who]
            lines.append(
                f"| {name} | {who} | {r['precision']:.2f} | {r['recall_precursor']:.2f} | "
                f"{r['recall_all']:.2f} | {r['median_lead_precursor_min']:.1f} | "
                f"{r['false_alarms_per_1000_gpu_days']:.2f} | {r['failures']} "
                f"({r['failures_with_precursor']}) | {r['gpu_days']:.0f} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write the report files; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
    (out / "report.md").write_text(_markdown(report))
    _plots(report, out)
    return {k: out / v for k, v in (("json", "report.json"), ("md", "report.md"),
                                     ("pr_curve", "pr_curve.png"),
                                     ("lead_times", "lead_times.png"))}
