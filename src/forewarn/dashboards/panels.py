"""How a forewarn dashboard is built: the label selectors every query filters on, the
query and panel builders (time series, stat, table, heatmap) and the dashboard frame with
its template variables. The dashboards themselves are :mod:`forewarn.dashboards.build`."""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import common, heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
G = 'cluster=~"$cluster", node=~"$node"'
"""Selector every GPU/node series carries."""
GPU = G + ', gpu=~"$gpu"'
JOB = 'cluster=~"$cluster", training_job=~"$job"'
# Training jobs carry forewarn's own ``training_job`` label, never Prometheus' scrape ``job``.
RANK_LEGEND = "{{training_job}} rank {{rank}}"

Panel = Any


def on_node(expr: str) -> str:
    """``expr`` (an agent self-metric, which carries no ``node`` label) with the ``node`` of
    the agent that exported it, found through ``forewarn_gpu_info`` of the same scrape
    target (``instance``), and filtered by ``$node``."""
    if "{" not in expr:
        expr += '{cluster=~"$cluster"}'
    return (f"{expr} * on (instance) group_left(node) "
            "max by (instance, node) (forewarn_gpu_info{" + G + "})")


def new_or_increase(counter: str) -> str:
    """Increase of ``counter`` over ``$__rate_interval``, counting a series born inside the
    interval at its value: Prometheus has no sample before a counter's first one, so
    ``increase()`` alone reads a first XID (a new ``code`` series at 1) as no increase."""
    return (f"(increase({counter}[$__rate_interval]) > 0) or "
            f"({counter} unless {counter} offset $__rate_interval)")


def q(expr: str, legend: str = "", instant: bool = False) -> prometheus.Dataquery:
    """A PromQL query on the ``$datasource`` (a range query unless ``instant``)."""
    q = prometheus.Dataquery().expr(expr).datasource(DS)
    if legend:
        q = q.legend_format(legend)
    return q.instant() if instant else q.range()


def threshold_steps(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    """Absolute thresholds: ``(value, colour)`` steps, the first with value None."""
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps]
    )


OK_WARN_BAD = threshold_steps((None, "green"), (1, "orange"), (2, "red"))


def ts(title: str, desc: str, unit: str, *queries: prometheus.Dataquery,
       thresholds: db.ThresholdsConfig | None = None, w: int = 12, h: int = 8,
       stack: bool = False) -> timeseries.Panel:
    """A time series panel of up to eight queries (refs A..H)."""
    p = (timeseries.Panel().title(title).description(desc).datasource(DS).unit(unit)
         .span(w).height(h).line_width(1).fill_opacity(10))
    for ref, target in zip("ABCDEFGH", queries, strict=False):
        p = p.with_target(target.ref_id(ref))
    if thresholds is not None:
        p = p.thresholds(thresholds)
    else:
        p = p.thresholds(threshold_steps((None, "green")))
    if stack:
        p = p.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL))
    return p


def st(title: str, desc: str, unit: str, query: prometheus.Dataquery,
       thresholds: db.ThresholdsConfig, w: int = 6, h: int = 4) -> stat.Panel:
    """A stat panel: the last value, its background coloured by ``thresholds``."""
    return (stat.Panel().title(title).description(desc).datasource(DS).unit(unit)
            .span(w).height(h).with_target(query.ref_id("A")).thresholds(thresholds)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]))
            .color_mode(cm.BigValueColorMode.BACKGROUND))


def tb(title: str, desc: str, unit: str, query: prometheus.Dataquery, w: int = 12,
       h: int = 8) -> table.Panel:
    """A table panel of one query (Prometheus table format)."""
    return (table.Panel().title(title).description(desc).datasource(DS).unit(unit)
            .span(w).height(h).with_target(query.ref_id("A").format(pm.PromQueryFormat.TABLE))
            .thresholds(threshold_steps((None, "green"))))


def hm(title: str, desc: str, unit: str, query: prometheus.Dataquery, w: int = 12,
       h: int = 8) -> heatmap.Panel:
    """A heatmap panel of one query (buckets as the query gives them)."""
    return (heatmap.Panel().title(title).description(desc).datasource(DS).unit(unit)
            .span(w).height(h).with_target(query.ref_id("A")).calculate(False)
            .thresholds(threshold_steps((None, "green"), (80, "orange"), (90, "red"))))


def _variables(*names: str) -> list[Any]:
    out: list[Any] = [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus"),
    ]
    sources = {
        "cluster": "label_values(forewarn_agent_build_info, cluster)",
        "node": 'label_values(forewarn_gpu_info{cluster=~"$cluster"}, node)',
        "gpu": 'label_values(forewarn_gpu_info{cluster=~"$cluster", node=~"$node"}, gpu)',
        "job": 'label_values(forewarn_rank_step{cluster=~"$cluster"}, training_job)',
    }
    for name in ("cluster", *names):
        out.append(
            db.QueryVariable(name).label(name.capitalize()).datasource(DS)
            .query(sources[name]).multi(True).include_all(True).all_value(".*")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .current(dm.VariableOption(selected=True, text="All", value="$__all"))
        )
    return out


def dashboard(uid: str, title: str, desc: str, tags: list[str], variables: list[str],
               rows: list[tuple[str, list[Panel]]],
               annotations: list[db.AnnotationQuery] | None = None) -> dict[str, Any]:
    """The dashboard as JSON: ``rows`` of panels, the template variables named in
    ``variables`` (``cluster`` always), tagged ``forewarn``."""
    d = (db.Dashboard(title).uid(uid).description(desc).tags(["forewarn", *tags])
         .refresh("30s").time("now-6h", "now").timezone("browser").editable())
    for v in _variables(*variables):
        d = d.with_variable(v)
    for a in annotations or []:
        d = d.annotation(a)
    for row_title, panels in rows:
        d = d.with_row(db.Row(row_title))
        for p in panels:
            d = d.with_panel(p)
    out: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    return out
