"""The failure predictor's metrics (:mod:`.predict`'s module docstring lists them),
rendered from its last scoring at scrape time."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .risk import gpu_series

if TYPE_CHECKING:
    from .predict import PredictorService

__all__ = ["PredictorMetrics"]


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


class PredictorMetrics:
    """Renders the last scoring at scrape time (no per-GPU work between scrapes)."""

    def __init__(self, svc: PredictorService) -> None:
        self.svc = svc

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        svc = self.svc
        sc = svc.scores
        yield from gpu_series(sc)
        st = svc.shadow_stats
        p = "forewarn_collector_prediction_"
        yield GaugeMetricFamily(p + "precision", "Shadow-scored precision of settled alarms "
                                "(NaN until an alarm settled).",
                                value=_nan(st.precision if st else None))
        yield GaugeMetricFamily(p + "recall", "Shadow-scored share of failures an alarm "
                                "preceded (NaN until a failure).",
                                value=_nan(st.recall if st else None))
        yield GaugeMetricFamily(p + "lead_seconds", "Median lead time of caught failures "
                                "(NaN until one).",
                                value=_nan(st.lead_time_median_s if st else None))
        yield GaugeMetricFamily(p + "open_alarms", "Alarm episodes not yet settled.",
                                value=st.open_alarms if st else 0)
        for name, attr, text in (
                ("alarms", "alarms", "Alarm episodes raised."),
                ("true_alarms", "true_alarms", "Alarm episodes a failure followed."),
                ("false_alarms", "false_alarms", "Alarm episodes no failure followed."),
                ("failures", "failures", "GPU failures seen (fatal XID, GPU lost, new "
                                         "uncorrectable errors)."),
                ("caught", "caught", "Failures an alarm preceded by the minimum lead.")):
            yield CounterMetricFamily(p + name, text, value=getattr(st, attr) if st else 0)
        q = "forewarn_collector_predictor_"
        yield GaugeMetricFamily(q + "up", "1 when a failure model is loaded.",
                                value=1.0 if svc.model is not None else 0.0)
        yield GaugeMetricFamily(q + "gpus", "GPUs scored at the last scoring.",
                                value=len(sc.scores))
        yield GaugeMetricFamily(q + "score_seconds", "Duration of the last scoring (its "
                                "parts' own time, not the urgent work run between them).",
                                value=svc.score_seconds)
        if svc.model is not None:
            yield GaugeMetricFamily(q + "threshold", "Operating threshold of the model: it "
                                    "alarms where forewarn_gpu_failure_score is at or above.",
                                    value=svc.model.threshold)
            yield GaugeMetricFamily(q + "horizon_seconds", "Prediction horizon of the model.",
                                    value=svc.model.horizon_s)
        if svc.drift is not None:
            yield from svc.drift.collect()
        samples = CounterMetricFamily(q + "samples", "Samples offered to the predictor.",
                                      labels=["result"])
        for k, v in svc.samples.items():
            samples.add_metric([k], v)
        yield samples
        # Fed samples the scorer's per-minute grid took out of time order: exported from
        # the start (0), so an alert's increase() sees the first.
        grid = CounterMetricFamily(q + "grid_samples", "Fed samples out of time order: late "
                                   "(counted into the open minute), too_far_ahead and "
                                   "repeated (refused).", labels=["result"])
        scorer = svc.scorer
        for k, attr in (("late", "late"), ("too_far_ahead", "skipped"),
                        ("repeated", "repeated")):
            grid.add_metric([k], getattr(scorer, attr) if scorer is not None else 0)
        yield grid
        snaps = svc.snapshots
        if snaps is not None:
            done = CounterMetricFamily(q + "state_snapshots", "Snapshots of the scorer's "
                                       "learned state (saved, restored, refused, failed, "
                                       "skipped, superseded).", labels=["result"])
            for k, v in snaps.counts.items():
                done.add_metric([k], v)
            yield done
            yield GaugeMetricFamily(q + "state_snapshot_bytes", "Size of the last snapshot "
                                    "of the scorer's learned state written.", value=snaps.bytes)
            yield GaugeMetricFamily(q + "state_capture_seconds", "The policy thread's share "
                                    "of the last snapshot (copying the scorer's arrays).",
                                    value=snaps.capture_seconds)
