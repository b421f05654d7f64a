"""Every query of every panel of every dashboard returns data from a real Prometheus.

A real stack on loopback: ``forewarn collector run`` (tmp data dir, enrolled token), a real
``forewarn agent --source sim`` on one simulated node whose scenario plays ECC, thermal,
PCIe (ending in XID 79), row-remap and NVLink faults within seconds, a small training job
of three rank processes using :class:`forewarn.hook.Monitor` (one reports a NaN loss, one
hangs), and Prometheus (Debian package) scraping the agent and the collector every second
with ``dashboards/rules/forewarn.rules.yml`` loaded.

Then every panel target and annotation of ``dashboards/*.json`` is run against
Prometheus's HTTP API with the template variables set to the stack's cluster, node and job
(a panel that can never show data is a bug), every variable's ``label_values`` query must
find values, and the alert rules must fire on the injected faults.

The stack (:class:`support.stack.Stack`) is shared with tests/collector/test_status_page_browser.py.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from forewarn.collector.metrics import CollectorMetrics
from forewarn.dashboards.metrics_doc import (
    DCGM_FIELDS,
    Family,
    merge,
    parse_exposition,
    parse_markdown,
    render,
)

from support.paths import REPO
from support.stack import (
    CLUSTER,
    DASHBOARDS,
    JOB,
    NODE,
    PromError,
    Stack,
    http_get,
    running_stack,
)

# -- the dashboards' queries --------------------------------------------------------------

VARIABLES = {
    "cluster": CLUSTER, "node": NODE, "job": JOB, "gpu": ".*",
    "__rate_interval": "1m", "__interval": "15s", "__range": "5m",
}


def substitute(expr: str) -> str:
    """Grafana's template variables as a dashboard user with this stack selected sees them."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in VARIABLES:
            raise AssertionError(f"unknown template variable ${name} in {expr!r}")
        return VARIABLES[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def dashboard_queries() -> list[tuple[str, str, bool]]:
    """``(where, expr, instant)`` for every panel target and annotation of every dashboard."""
    out: list[tuple[str, str, bool]] = []
    files = sorted(DASHBOARDS.glob("*.json"))
    assert len(files) >= 5, files
    for path in files:
        dash = json.loads(path.read_text())
        panels = [p for p in dash["panels"] if p.get("type") != "row"]
        panels += [q for p in dash["panels"] for q in p.get("panels", [])]  # collapsed rows
        for p in panels:
            for t in p.get("targets", []):
                where = f"{path.name} / panel {p['title']!r} / {t.get('refId', '?')}"
                out.append((where, t["expr"], bool(t.get("instant"))))
        for a in dash.get("annotations", {}).get("list", []):
            if a.get("expr"):
                out.append((f"{path.name} / annotation {a['name']!r}", a["expr"], False))
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """``(where, selector, label)`` for every ``label_values(selector, label)`` variable."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for v in json.loads(path.read_text())["templating"]["list"]:
            q = v.get("query")
            text = q.get("query", "") if isinstance(q, dict) else str(q or "")
            if v.get("type") != "query":
                continue
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text.strip())
            assert m, f"{path.name} / variable {v['name']}: not a label_values query: {text!r}"
            out.append((f"{path.name} / variable ${v['name']}", m.group(1), m.group(2)))
    return out


def run_panel_query(stack: Stack, expr: str, instant: bool, since: float
                    ) -> list[dict[str, Any]]:
    """Series the query returns as Grafana runs it: instant at now, or over the range."""
    q = substitute(expr)
    if instant:
        return stack.query(q)
    now = time.time()
    data = stack.prom("query_range", query=q, start=f"{since:.3f}", end=f"{now:.3f}",
                      step="1")
    result: list[dict[str, Any]] = data["result"]
    return result


def joined_labels_wrong(expr: str, series: list[dict[str, Any]]) -> str:
    """Panels that join labels in (the node of an agent's self-metrics, the job and rank
    over a GPU, or the job alone for a per-job sum) must carry the stack's values; '' when
    they do."""
    want: dict[str, str] = {}
    if "group_left(node)" in expr:
        want["node"] = NODE
    per_rank = "forewarn_rank_info" in expr and not expr.startswith("sum by (training_job)")
    if "forewarn_rank_info" in expr:
        want.update(training_job=JOB, **({"node": NODE} if per_rank else {}))
    for s in series:
        got = {k: s["metric"].get(k) for k in want}
        if got != want or (per_rank and not s["metric"].get("rank")):
            return f"series {s['metric']} lacks {want} (or a rank)"
    return ""


EXPECTED_ALERTS: dict[str, dict[str, str]] = {
    "ForewarnGpuUnhealthy": {"node": NODE},
    "ForewarnGpuLost": {"node": NODE, "gpu": "3"},
    "ForewarnXidHardware": {"node": NODE, "gpu": "3", "code": "79", "class": "bus"},
    "ForewarnEccUncorrectable": {"node": NODE, "gpu": "1"},
    "ForewarnRowRemapFailure": {"node": NODE, "gpu": "4"},
    "ForewarnNanLoss": {"node": NODE, "training_job": JOB, "rank": "1"},
    "ForewarnRankHang": {"node": NODE, "training_job": JOB, "rank": "2"},
}
"""Alerts the injected faults must fire, each with labels one firing instance must carry."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory,
          require_binary: Callable[[str], str]) -> Iterator[Stack]:
    prometheus = require_binary("prometheus")
    with running_stack(tmp_path_factory.mktemp("dash"), prometheus) as s:
        s.wait_for("first scrape of agent and collector",
                   lambda: len(s.query("up == 1")) == 2, timeout=60)
        yield s


@pytest.mark.timeout(180)
def test_rules_fire_on_injected_faults(stack: Stack) -> None:
    def all_firing() -> bool:
        firing = stack.firing()
        return all(any(labels.items() <= a.items() for a in firing.get(name, []))
                   for name, labels in EXPECTED_ALERTS.items())

    try:
        stack.wait_for("the alerts of the injected faults", all_firing, timeout=60, every=1)
    except AssertionError as exc:
        firing = stack.firing()
        missing = {n: want for n, want in EXPECTED_ALERTS.items()
                   if not any(want.items() <= a.items() for a in firing.get(n, []))}
        raise AssertionError(f"{exc}\nnot firing (with these labels): {missing}\n"
                             f"firing: {json.dumps(firing, indent=1)}") from None
    firing = stack.firing()
    xids = {a["code"] for a in firing["ForewarnXidHardware"]}
    assert {"48", "64", "74", "79"} <= xids, xids  # every hardware XID of the scenario
    for name in firing:  # checkpoint-worthy alerts name what to checkpoint
        assert name.startswith("Forewarn"), name
    # The pipeline itself is fine: nothing says otherwise.
    assert not {"ForewarnAgentDown", "ForewarnCollectorUnreachable", "ForewarnSpoolDropping"
                } & firing.keys(), firing.keys()


@pytest.mark.timeout(300)
def test_every_panel_query_returns_data(stack: Stack) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 40, len(queries)
    # Wait for the slowest signals (the last terminal fault, the job's checkpoint, the
    # collector's decisions), then allow a few more seconds for anything still to come.
    stack.wait_for("XID 79, a saved checkpoint and a collector decision", lambda: (
        stack.query(f'forewarn_gpu_xid_errors_total{{node="{NODE}",code="79"}}')
        and stack.query(f'forewarn_checkpoint_bytes{{training_job="{JOB}"}}')
        and stack.query("forewarn_collector_decisions_total")), timeout=60, every=1)
    # The predictor scores a GPU once a full minute of its samples is in (features are per
    # minute, as in training): the risk panels fill about 60-70 s after the first sample.
    stack.wait_for("the shipped predictor's first scores", lambda: stack.query(
        "forewarn_gpu_failure_probability"), timeout=150, every=2)
    since = stack.started
    pending = {where: (expr, instant) for where, expr, instant in queries}
    errors: dict[str, str] = {}
    deadline = time.monotonic() + 15
    while pending:
        for where, (expr, instant) in list(pending.items()):
            try:
                series = run_panel_query(stack, expr, instant, since)
                if series:
                    del pending[where]
                    if wrong := joined_labels_wrong(expr, series):
                        errors[where] = f"{substitute(expr)}\n      error: {wrong}"
            except PromError as exc:
                errors[where] = f"{substitute(expr)}\n      error: {exc}"
                del pending[where]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(1)
    empty = {w: substitute(e) for w, (e, _i) in pending.items()}
    # honor_labels keeps the agent's labels; the training job has its own label, so the
    # scrape job survives on every series (a training `job` label used to overwrite it).
    assert stack.query(f'forewarn_rank_step{{job="forewarn-agent",training_job="{JOB}"}}')
    assert stack.query(f'forewarn_job_goodput_ratio{{job="forewarn-collector",'
                       f'training_job="{JOB}"}}')

    bad_vars = []
    for where, selector, label in variable_queries():
        sel = substitute(selector)
        rows = stack.query(f"count by ({label}) ({sel})")
        if not [r for r in rows if r["metric"].get(label)]:
            bad_vars.append(f"{where}: no {label!r} values in {sel}")

    report = "".join(f"\n  {w}\n      {e}" for w, e in sorted(empty.items()))
    report += "".join(f"\n  {w}\n      {e}" for w, e in sorted(errors.items()))
    report += "".join(f"\n  {v}" for v in bad_vars)
    assert not (empty or errors or bad_vars), (
        f"{len(empty)} of {len(queries)} panel queries return no series, "
        f"{len(errors)} fail, {len(bad_vars)} variables find nothing:{report}")


# -- docs/metrics.md ----------------------------------------------------------------------

METRICS_DOC = REPO / "docs" / "metrics.md"
RICH_AGENT_FAMILIES = ("forewarn_rank_step", "forewarn_checkpoint_bytes",
                       "forewarn_checkpoint_orders_total", "forewarn_finding_active")
RICH_COLLECTOR_FAMILIES = ("forewarn_job_goodput_ratio",)


def test_metrics_doc_matches_what_the_code_exports(stack: Stack) -> None:
    """docs/metrics.md documents every family the agent and collector expose (after the
    stack above ran every fault, ranks and checkpoints), with the same type, unit, HELP and
    at least the labels seen; ``FOREWARN_REGEN_METRICS_DOC=1`` rewrites it from this scrape."""
    urls = {"agent": f"http://{stack.agent_address}/metrics",
            "collector": f"{stack.collector_url}/metrics"}
    scraped: dict[str, dict[str, Family]] = {s: {} for s in urls}

    def scrape() -> bool:
        """Merge one scrape of each; true once the per-rank and per-job families carry
        samples (label sets are read from samples)."""
        for section, url in urls.items():
            status, body = http_get(url)
            assert status == 200, (url, status)
            scraped[section] = merge(scraped[section], parse_exposition(body.decode()))
        agent, collector = scraped["agent"], scraped["collector"]
        return all(f in agent and agent[f].labels for f in RICH_AGENT_FAMILIES) and all(
            f in collector and collector[f].labels for f in RICH_COLLECTOR_FAMILIES)

    stack.wait_for("rank, checkpoint and goodput series", scrape, timeout=120, every=1)
    # A labelled counter with no series yet shows no labels in a scrape: take the collector's
    # declared label names from its metric objects (prometheus_client keeps them private).
    declared = {}
    for metric in vars(CollectorMetrics()).values():
        if isinstance(metric, MetricWrapperBase):
            name = metric._name + ("_total" if metric._type == "counter" else "")
            declared[name] = Family(name, metric._type, metric._documentation,
                                    frozenset(metric._labelnames))
    scraped["collector"] = merge(scraped["collector"],
                                 {k: v for k, v in declared.items() if k in scraped["collector"]})
    assert set(DCGM_FIELDS) <= set(scraped["agent"]), set(DCGM_FIELDS) - set(scraped["agent"])
    if os.environ.get("FOREWARN_REGEN_METRICS_DOC") == "1":
        METRICS_DOC.write_text(render({s: f.values() for s, f in scraped.items()}))
    documented = parse_markdown(METRICS_DOC.read_text())
    wrong = []
    for section, families in scraped.items():
        doc = documented.get(section, {})
        for name, fam in sorted(families.items()):
            have = doc.get(name)
            if have is None:
                wrong.append(f"{section}: {name} is not documented")
            elif (have.type, have.unit, have.help) != (fam.type, fam.unit, fam.help):
                wrong.append(f"{section}: {name} documented as {have}, exported as {fam}")
            elif not fam.labels <= have.labels:
                wrong.append(f"{section}: {name} lacks labels {sorted(fam.labels - have.labels)}")
    assert not wrong, ("docs/metrics.md disagrees with the code (regenerate on purpose with "
                       "FOREWARN_REGEN_METRICS_DOC=1):\n" + "\n".join(wrong))
