"""Reading one sample of an in-process Prometheus registry (a collector's or an uplink's
``CollectorRegistry``), 0 when it has none yet. A ``/metrics`` body is read with
:mod:`forewarn.chaos.exposition`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

__all__ = ["value"]


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` in ``registry``; 0 when absent (a
    labelled counter has no sample before its first increment)."""
    return registry.get_sample_value(name, labels) or 0.0
