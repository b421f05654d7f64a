"""Reading one sample out of a Prometheus text exposition (a /metrics body), parsed with
prometheus_client's own parser: label order and escaping are the parser's business."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["sample"]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` in ``text`` whose labels are exactly ``labels``
    (in any order; none for an unlabelled sample), or ``None`` when there is none."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None
