"""Prometheus label values made safe: bounded, valid UTF-8, still one series per value.

Label values come from outside (job names from training hooks and agents, GPU names and
UUIDs from drivers and replay files). The text exposition escapes quotes, backslashes and
newlines itself; what it cannot do is bound a value (a scrape with a label longer than
Prometheus' ``label_value_length_limit`` is refused whole) or encode a string that is not
valid Unicode (a lone surrogate made every scrape fail with ``UnicodeEncodeError``).

:class:`BoundedLabelsRegistry` applies :func:`label_value` to every label of every sample
at scrape time, so no collector has to remember it. The agent's and the collector's
registries are bounded registries.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

__all__ = ["LABEL_MAX", "BoundedLabelsRegistry", "label_value"]

LABEL_MAX = 128
"""Most characters in a label value. A longer value keeps its first 119 characters, then
``…`` and 8 hex digits of its SHA-256, so two long values stay two series."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def label_value(value: str) -> str:
    """``value`` as valid UTF-8 (lone surrogates become U+FFFD) of at most
    :data:`LABEL_MAX` characters."""
    if len(value) <= LABEL_MAX and value.isascii():
        return value  # the common case, checked cheaply: scrapes render every label
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = _SURROGATE.sub("\ufffd", value)
    if len(value) <= LABEL_MAX:
        return value
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:8]
    return value[:LABEL_MAX - 9] + "…" + digest


class BoundedLabelsRegistry(CollectorRegistry):
    """A registry whose scrapes carry only :func:`label_value`-safe label values."""

    def collect(self) -> Iterable[Metric]:
        for metric in super().collect():
            # Most samples carry short ASCII labels only: keep those as they are (a scrape
            # of an 8-GPU agent renders hundreds of samples).
            metric.samples = [
                s if all(len(v) <= LABEL_MAX and v.isascii() for v in s.labels.values())
                else s._replace(labels={k: label_value(v) for k, v in s.labels.items()})
                for s in metric.samples
            ]
            yield metric
