"""A real VictoriaMetrics single-node server for tests (``victoria-metrics`` from the
machine), on a free loopback port with its data in a temp dir: the Prometheus-compatible
series store that the collector's remote write feeds
(:class:`forewarn.demo.servers.VictoriaMetrics`, which ``forewarn demo --scale-out`` uses
too)."""

from __future__ import annotations

from forewarn.demo.servers import VictoriaMetrics

__all__ = ["VictoriaMetrics"]
