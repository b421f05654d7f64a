"""Inbound alert webhooks: Alertmanager (payload version 4) and Grafana alerting.

Both post ``{"alerts": [{"status": "firing", "labels": {...}, "annotations": {...}}, ...]}``
(Grafana's contact-point webhook keeps Alertmanager's shape and adds ``orgId``, ``title``,
``state``). Each firing alert names what it is about in its labels; the first of these
that is present decides the subject:

* ``training_job`` (forewarn's own label on every per-job series), ``forewarn_job``, or, for
  rules written before, ``job`` -> that training job (only when the job map knows it: the
  Prometheus ``job`` label usually names a scrape job, not a training job);
* ``UUID`` / ``uuid`` / ``gpu_uuid`` -> the GPU with that UUID (DCGM exporter);
* ``node`` / ``Hostname`` / ``hostname`` / ``instance`` (port removed) with ``gpu`` /
  ``gpu_index`` -> that GPU, else that node.

Each becomes a :class:`~forewarn.wire.Finding` (``check="alert:<alertname>"``, health
``unhealthy`` when the ``severity`` label is ``critical``/``page``, else ``degraded``,
suggested action ``checkpoint``) that goes through the one policy with the cost model
bypassed: an operator's alert rule asked for a checkpoint; dedup, cooldown, rate limits,
the circuit breaker and shadow mode still apply.

Only alerts that start firing become findings: the same labels firing again (Alertmanager
re-sends at every group and repeat interval) only update the alert's row
(:mod:`.alert_book`). The routes answer ``{"findings": new, "duplicates": n, "resolved": n,
"skipped": [why, ...]}`` at once; the policy's decisions follow on its thread
(``GET /api/v1/decisions``).

The routes ``POST /api/v1/alerts/alertmanager`` and ``POST /api/v1/alerts/grafana``
(:mod:`forewarn.collector.http.policy_routes`) require
``Authorization: Bearer <alert_token>`` (Alertmanager: ``http_config.authorization``;
Grafana: the webhook contact point's authorization header). With no token configured the
routes refuse every request (403): security by default.
"""

from __future__ import annotations

import dataclasses
import logging

import msgspec

from forewarn.wire import (
    DECODE_ERRORS,
    Finding,
    Health,
    Subject,
    SuggestedAction,
    decode_error_message,
)

from ..jobs.jobview import JobView, node_of_instance

__all__ = [
    "MAX_ALERT_BODY",
    "Alert",
    "AlertPayload",
    "AlertTarget",
    "alert_finding",
    "alert_findings",
    "alert_labels",
    "parse_alerts",
]

log = logging.getLogger(__name__)

MAX_ALERT_BODY = 1024 * 1024
"""Largest accepted alert webhook body (Alertmanager batches alerts per group)."""

_NODE_LABELS = ("node", "Hostname", "hostname", "instance")
_GPU_LABELS = ("gpu", "gpu_index")
_UUID_LABELS = ("UUID", "uuid", "gpu_uuid")
# ``job`` last: in Prometheus it is the scrape job, so only a known training job counts.
_JOB_LABELS = ("training_job", "forewarn_job", "job")
_CRITICAL = frozenset({"critical", "page", "error"})

Labels = dict[str, str]


class Alert(msgspec.Struct, kw_only=True):
    """One alert of an Alertmanager/Grafana webhook (fields forewarn reads)."""

    status: str = "firing"
    labels: Labels = msgspec.field(default_factory=dict)
    annotations: Labels = msgspec.field(default_factory=dict)


class AlertPayload(msgspec.Struct, kw_only=True):
    """An Alertmanager (``version: "4"``) or Grafana alerting webhook body."""

    version: str = ""
    status: str = ""
    receiver: str = ""
    alerts: list[Alert] = msgspec.field(default_factory=list)
    commonLabels: Labels = msgspec.field(default_factory=dict)
    title: str = ""


@dataclasses.dataclass(frozen=True)
class AlertTarget:
    """What one firing alert is about, resolved against the job map."""

    alertname: str
    subject: Subject
    severity: str
    summary: str


def parse_alerts(body: bytes) -> AlertPayload:
    """Decode a webhook body; ``ValueError`` names the problem."""
    try:
        payload = msgspec.json.decode(body, type=AlertPayload)
    except DECODE_ERRORS as exc:
        raise ValueError(decode_error_message(exc, "alert webhook body")) from None
    if len(payload.alerts) > 10_000:
        raise ValueError(f"too many alerts in one request: {len(payload.alerts)}")
    return payload


def _first(labels: Labels, names: tuple[str, ...]) -> str:
    for name in names:
        value = labels.get(name, "").strip()
        if value:
            return value
    return ""


def _subject(labels: Labels, jobs: JobView) -> Subject | None:
    job = _first(labels, _JOB_LABELS)
    if job and jobs.job(job) is not None:
        return Subject(kind="job", job=job[:256])
    uuid = _first(labels, _UUID_LABELS)
    if uuid:
        found = jobs.resolve_uuid(uuid)
        if found is not None:
            return Subject(kind="gpu", node=found[0], gpu=found[1])
    raw_node = _first(labels, _NODE_LABELS)
    if not raw_node:
        return None
    node = node_of_instance(raw_node)[:256]
    gpu = _first(labels, _GPU_LABELS)
    if gpu.isdigit() and len(gpu) < 7:
        return Subject(kind="gpu", node=node, gpu=int(gpu))
    return Subject(kind="node", node=node)


def alert_labels(payload: AlertPayload, alert: Alert) -> Labels:
    """The alert's labels with the payload's common labels (the alert's win)."""
    return {**payload.commonLabels, **alert.labels}


def alert_finding(payload: AlertPayload, alert: Alert, jobs: JobView, source: str,
                  now: float) -> Finding | str:
    """The finding for one firing alert, or why it was skipped."""
    labels = alert_labels(payload, alert)
    name = labels.get("alertname", "") or payload.title or "alert"
    if alert.status != "firing":
        return f"{name}: status {alert.status!r}, not firing"
    subject = _subject(labels, jobs)
    if subject is None:
        return f"{name}: no node, GPU or known job in the labels"
    severity = labels.get("severity", "").lower()
    summary = alert.annotations.get("summary") or alert.annotations.get("description") or ""
    reason = f"{source} alert {name}: {summary}".strip().rstrip(":")
    evidence: dict[str, float | int | str | bool | None] = {
        k[:64]: v[:256] for k, v in list(labels.items())[:32]
    }
    return Finding(
        check=f"alert:{name}"[:256],
        health=Health.UNHEALTHY if severity in _CRITICAL else Health.DEGRADED,
        subject=subject,
        reason=reason[:4096],
        action=SuggestedAction.CHECKPOINT,
        evidence=evidence,
        time=now,
    )


def alert_findings(
    payload: AlertPayload, jobs: JobView, source: str, now: float
) -> tuple[list[Finding], list[str]]:
    """Findings for the firing alerts of ``payload``, and why others were skipped."""
    findings: list[Finding] = []
    skipped: list[str] = []
    for i, alert in enumerate(payload.alerts):
        found = alert_finding(payload, alert, jobs, source, now)
        if isinstance(found, str):
            skipped.append(f"alerts[{i}] {found}")
        else:
            findings.append(found)
    return findings, skipped
