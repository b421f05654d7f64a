"""Reading samples out of a Prometheus text exposition (a ``/metrics`` body), parsed with
prometheus_client's own parser (label order and escaping are the parser's business): the
one reader of the chaos suite, the demo and the tests.

Two ways to pick samples, both on one parse: :func:`sample` is the one sample whose labels
are exactly these (in any order; none for an unlabelled sample); :func:`matching` lists
every sample that carries these labels, whatever others it has, and :func:`total` sums them
(a counter over all its reasons, say). :func:`scrape` is :func:`total` over a URL."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["fetch", "matching", "sample", "samples", "scrape", "total"]


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample named ``name`` in ``text``: (its labels, its value), in text order."""
    return [(dict(s.labels), float(s.value)) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels are exactly ``labels``, or ``None``
    when there is none (a subset of its labels is not a match)."""
    return next((value for got, value in samples(text, name) if got == labels), None)


def matching(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples ``name`` that carry ``labels`` (and any others)."""
    return [value for got, value in samples(text, name)
            if all(got.get(k) == v for k, v in labels.items())]


def total(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples ``name`` that carry ``labels`` (and any others), or ``None``
    when there is none."""
    found = matching(text, name, **labels)
    return sum(found) if found else None


def fetch(url: str, timeout: float = 2.0) -> str:
    """The body of a ``/metrics`` URL."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read()).decode()


def scrape(url: str, name: str, labels: dict[str, str] | None = None,
           timeout: float = 2.0) -> float | None:
    """:func:`total` of the samples ``name`` (with ``labels``) at a ``/metrics`` URL."""
    return total(fetch(url, timeout), name, **(labels or {}))
