"""Upkeep of the collector's data while it runs: retention and scrub.

:func:`apply_retention` prunes everything older than ``retention_days`` (Parquet days,
then database rows, see :meth:`~forewarn.collector.storage.store.Store.prune`), compacts finished
days and publishes the rows pruned and the size of the data directory as metrics.
:func:`run_upkeep` is the app's periodic task: retention every ``retention_interval_s``,
the scrub (:meth:`~forewarn.collector.storage.telemetry.TelemetryWriter.scrub`) every
``scrub_interval_s``, both in worker threads and apart from the Parquet flush, so neither
delays a flush nor ingest. A failed pass is logged and counted
(``upkeep_errors_total{task}``) and tried again at its next interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..config import CollectorConfig
from ..metrics import CollectorMetrics
from .datadir import data_sizes
from .state import StateStore
from .telemetry import TelemetryWriter

__all__ = ["apply_retention", "run_upkeep"]

log = logging.getLogger(__name__)


def apply_retention(config: CollectorConfig, store: StateStore, telemetry: TelemetryWriter,
                    metrics: CollectorMetrics, now: float) -> dict[str, int]:
    """One retention pass at Unix time ``now``; returns the rows pruned per table."""
    telemetry.prune(now)
    telemetry.compact_old_days(now)
    counts = store.prune(now - config.retention_days * 86400.0)
    for table, n in counts.items():
        metrics.pruned.labels(table).inc(n)
    if any(counts.values()):
        log.info("retention pruned %s", ", ".join(f"{n} {t}" for t, n in counts.items() if n))
    for part, size in data_sizes(config.data_dir).items():
        metrics.data_bytes.labels(part).set(size)
    return counts


async def run_upkeep(config: CollectorConfig, store: StateStore, telemetry: TelemetryWriter,
                     metrics: CollectorMetrics, clock: Callable[[], float]) -> None:
    """Retention and scrub on their intervals, the first of each at once; runs until
    cancelled."""
    due = {"retention": 0.0, "scrub": 0.0}
    interval = {"retention": config.retention_interval_s, "scrub": config.scrub_interval_s}
    while True:
        for task in due:
            if time.monotonic() < due[task]:
                continue
            try:
                if task == "retention":
                    await asyncio.to_thread(apply_retention, config, store, telemetry,
                                            metrics, clock())
                else:
                    await asyncio.to_thread(telemetry.scrub)
            except Exception:
                metrics.upkeep_errors.labels(task).inc()
                log.exception("%s pass failed; tried again in %.0f s", task, interval[task])
            due[task] = time.monotonic() + interval[task]
        await asyncio.sleep(max(0.0, min(due.values()) - time.monotonic()))
