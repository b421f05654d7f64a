"""Findings with an identity and a lifecycle, grouped into incidents.

A **tracked finding** is one thing a source says is wrong: its key is the source, the
subject (a GPU, a node, a rank or a job) and the check, e.g.
``agent|gpu:node7/3|xid`` or ``alertmanager|gpu:node7/3|alert:ForewarnGpuXidFatal``; it has an
id of its own. Its state:

* ``firing`` from its first non-healthy report;
* ``resolved`` when its source says it is over: the agent's healthy finding of the same
  check and subject, or an Alertmanager/Grafana alert that resolved;
* ``expired`` when its source went silent for ``ttl_s``: for an agent, no batch from the node
  (the agent re-sends a finding only when it changes, so its batches are the heartbeat); for
  an alert, no re-send (Alertmanager re-sends firing alerts at every ``repeat_interval``).

An **incident** groups the findings about one *scope* that arrive within ``window_s`` of one
another or while one of them fires: a GPU (``gpu:node/index``), a node for node-wide
findings (``node:name``), a job for rank and job findings (``job:id``). One double-bit error
gives an XID 48 finding and an uncorrectable-ECC finding: one incident. The policy orders
a job at most once per incident (:mod:`.policy`), and holds its saves at most once, unless
the incident **escalates** (an order; a hold never repeats): a
finding worse than the incident's health so far, or a finding materially worse than its own
previous report (:func:`forewarn.escalation.escalates`: remapped rows growing under one
"remap pending"). An incident is ``open`` while a finding fires and ends ``resolved`` or
``expired`` with its last finding.

The book is in memory, used from the policy thread only; :func:`save_incidents` writes the
incidents that changed to the store's ``incidents`` table (the read API
``GET /api/v1/incidents`` and the status page), and :meth:`IncidentBook.load` takes the open
ones back after a restart.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from forewarn.escalation import escalates
from forewarn.wire import Finding, Health, Subject

from ..storage.state import StateStore

__all__ = ["FindingState", "Incident", "IncidentBook", "Observation", "StoredAct",
           "TrackedFinding", "finding_key", "incident_scope", "save_incidents", "tracked_key"]

DEFAULT_WINDOW_S = 300.0
"""Findings about one scope within this long of the incident's last one join it."""


class FindingState(enum.StrEnum):
    """Where a tracked finding is in its life (module docstring)."""

    FIRING = "firing"
    RESOLVED = "resolved"
    EXPIRED = "expired"


def finding_key(finding: Finding, source: str) -> str:
    """The identity of what ``finding`` is about: source, subject and check."""
    return tracked_key(source, finding.subject.key(), finding.check)


def tracked_key(source: str, subject: str, check: str) -> str:
    """:func:`finding_key` from its parts (``subject``: :meth:`Subject.key`)."""
    return f"{source}|{subject}|{check}"


def incident_scope(subject: Subject) -> tuple[str, str]:
    """(scope, kind) of the incident a finding about ``subject`` belongs to."""
    if subject.kind == "gpu" and subject.gpu is not None:
        return f"gpu:{subject.node}/{subject.gpu}", "gpu"
    if subject.kind in ("rank", "job") and subject.job:
        return f"job:{subject.job}", "job"
    return f"node:{subject.node}", "node"


def _liveness_key(source: str, finding: Finding) -> str:
    """Whose silence expires the finding: the node's agent, else the finding itself."""
    return f"agent:{finding.subject.node}" if source == "agent" else ""


@dataclasses.dataclass
class TrackedFinding:
    """A finding with its identity and state (module docstring)."""

    id: str
    key: str
    source: str
    finding: Finding
    state: FindingState
    first_seen: float
    last_seen: float
    closed: float | None = None

    def as_json(self) -> dict[str, Any]:
        f = self.finding
        return {"id": self.id, "key": self.key, "source": self.source, "state": self.state.value,
                "check": f.check, "subject": f.subject.key(), "health": f.health.value,
                "action": f.action.value, "reason": f.reason, "first_seen": self.first_seen,
                "last_seen": self.last_seen, "closed": self.closed,
                "finding": msgspec.to_builtins(f)}


@dataclasses.dataclass
class Incident:
    """Correlated findings about one scope (module docstring)."""

    id: str
    scope: str
    kind: str
    subject: Subject
    opened: float
    updated: float
    findings: dict[str, TrackedFinding] = dataclasses.field(default_factory=dict)
    orders: int = 0
    ordered: dict[str, Finding] = dataclasses.field(default_factory=dict)
    """Job -> the finding that last ordered its checkpoint in this incident."""
    held: dict[str, int] = dataclasses.field(default_factory=dict)
    """Jobs whose saves this incident held, with the onset step held (once per job and
    incident, unless a finding shows an earlier onset)."""
    worst: Health = Health.HEALTHY
    """The worst health any of its findings reached."""
    closed: float | None = None

    @property
    def state(self) -> str:
        """``open`` while a finding fires, else how the last one ended."""
        if self.closed is None:
            return "open"
        last = max(self.findings.values(), key=lambda t: t.closed or 0.0)
        return last.state.value

    @property
    def health(self) -> Health:
        """The worst health of its firing findings (healthy once none fires)."""
        firing = [t.finding.health for t in self.findings.values()
                  if t.state == FindingState.FIRING]
        return max(firing, key=lambda h: h.severity, default=Health.HEALTHY)

    def row(self) -> tuple[Any, ...]:
        """The ``incidents`` table row."""
        checks = sorted({t.finding.check for t in self.findings.values()})
        return (self.id, self.scope, self.kind, self.subject.node, self.subject.gpu,
                self.subject.job, self.state, self.health.value, self.worst.value,
                ",".join(checks), self.opened, self.updated, self.closed, self.orders,
                json.dumps([t.as_json() for t in self.findings.values()]))


@dataclasses.dataclass(frozen=True)
class StoredAct:
    """A checkpoint order or a save hold a previous leader carried out, as its stored
    decision tells it (:mod:`.gate_history`)."""

    incident: str
    job: str
    time: float
    check: str | None = None
    """The check of the finding that ordered (None: the decision stored none)."""
    onset: int | None = None
    """A hold's onset step."""
    source: str = "agent"
    finding: Finding | None = None
    """The finding decided, when the ``incidents`` table never had ``incident`` (else
    ``None``: the stored incident is taken over as it is)."""


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one non-healthy finding did to the book."""

    tracked: TrackedFinding
    incident: Incident
    escalated: bool
    """Worse than the incident so far, or materially worse than its own last report."""
    opened: bool
    """The finding opened the incident."""


class IncidentBook:
    """Tracked findings and incidents (module docstring). Not thread-safe."""

    def __init__(self, *, window_s: float = DEFAULT_WINDOW_S, ttl_s: float = 7200.0,
                 clock: Callable[[], float] = time.time,
                 registry: CollectorRegistry | None = None,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex[:16]) -> None:
        self.window_s = window_s
        self.ttl_s = ttl_s
        self.clock = clock
        self._new_id = new_id
        self._open: dict[str, Incident] = {}
        """Scope -> its current incident (open, or closed less than ``window_s`` ago)."""
        self._alive: dict[str, float] = {}
        """Liveness key -> when its source was last heard."""
        self._changed: dict[str, Incident] = {}
        self._rebuilt: set[str] = set()
        """Incidents opened again from stored orders and holds (:meth:`_taken_over`)."""
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._m_opened = Counter("forewarn_collector_incidents",
                                 "Incidents opened, by scope kind (gpu, node, job).", ["kind"],
                                 registry=registry)
        self._m_open = Gauge("forewarn_collector_incidents_open",
                             "Incidents open now (a finding of theirs fires).", registry=registry)
        self._m_active = Gauge("forewarn_collector_findings_active",
                               "Tracked findings firing now, by source.", ["source"],
                               registry=registry)
        self._m_closed = Counter("forewarn_collector_findings_closed",
                                 "Tracked findings that stopped firing, by how: resolved (their "
                                 "source said so) or expired (their source went silent).",
                                 ["state"], registry=registry)
        self._sources: set[str] = set()

    # -- findings in -----------------------------------------------------------------------

    def observe(self, finding: Finding, source: str, now: float) -> Observation | None:
        """A finding through the policy: a healthy one resolves its key (None); an unknown
        one changes nothing (None); a degraded or unhealthy one fires in its incident."""
        if finding.health == Health.HEALTHY:
            self.close(finding, source, now, FindingState.RESOLVED)
            return None
        if finding.health == Health.UNKNOWN:
            return None
        scope, kind = incident_scope(finding.subject)
        incident = self._open.get(scope)
        opened = False
        if incident is None or (incident.closed is not None
                                and now - incident.updated > self.window_s):
            incident = Incident(self._new_id(), scope, kind, finding.subject, now, now)
            self._open[scope] = incident
            self._m_opened.labels(kind).inc()
            opened = True
        key = finding_key(finding, source)
        tracked = incident.findings.get(key)
        escalated = finding.health.severity > incident.worst.severity and not opened
        if tracked is not None and tracked.state == FindingState.FIRING:
            escalated = escalated or escalates(tracked.finding, finding)
            tracked.finding, tracked.last_seen = finding, now
        else:
            tracked = TrackedFinding(self._new_id(), key, source, finding, FindingState.FIRING,
                                     now, now)
            incident.findings[key] = tracked
        if finding.health.severity > incident.worst.severity:
            incident.worst = finding.health
        incident.closed = None
        self._touched(incident, now)
        return Observation(tracked, incident, escalated, opened)

    def ordered(self, obs: Observation, job: str) -> None:
        """The policy ordered ``job`` to checkpoint because of ``obs``."""
        obs.incident.ordered[job] = obs.tracked.finding
        obs.incident.orders += 1
        self._changed[obs.incident.id] = obs.incident

    def ordered_before(self, act: StoredAct) -> None:
        """A previous leader ordered ``act.job`` in the incident ``act.incident`` (its
        stored decision says so): the finding that ordered it (else the incident's tracked
        finding of that check, else its first) stands for what ordered it. An incident
        the store never had is taken over from ``act`` (:meth:`_taken_over`)."""
        for incident in self._taken_over(act):
            tracked = [t.finding for t in incident.findings.values()]
            if act.job in incident.ordered or not tracked:
                continue
            incident.ordered[act.job] = act.finding or next(
                (f for f in tracked if f.check == act.check), tracked[0])
            if incident.id in self._rebuilt:
                incident.orders += 1

    def held(self, obs: Observation, job: str, onset: int) -> None:
        """The policy held ``job``'s saves from ``onset`` because of ``obs``."""
        obs.incident.held[job] = min(onset, obs.incident.held.get(job, onset))

    def held_before(self, act: StoredAct) -> None:
        """A previous leader held ``act.job``'s saves from ``act.onset`` in the incident
        ``act.incident`` (its stored decision says so); an incident the store never had is
        taken over from ``act`` (:meth:`_taken_over`)."""
        onset = act.onset or 0
        for incident in self._taken_over(act):
            incident.held[act.job] = min(onset, incident.held.get(act.job, onset))

    def _taken_over(self, act: StoredAct) -> list[Incident]:
        """The open incident ``act.incident``. One the ``incidents`` table never had (its
        leader died after it queued the order and before it stored the incident, or the
        store refused that write) is opened again from ``act.finding`` (a firing finding of
        ``act.source``; its source gets ``ttl_s`` from now to speak), unless another
        incident holds its scope: so the fault's next finding joins it, as it would have
        on the old leader."""
        found = self._with_id(act.incident)
        if act.finding is None or (found and act.incident not in self._rebuilt):
            return found
        if found:  # another order or hold of an incident rebuilt here
            self._add(found[0], act)
            return found
        scope, kind = incident_scope(act.finding.subject)
        if scope in self._open:
            return []
        incident = Incident(act.incident, scope, kind, act.finding.subject, act.time, act.time)
        self._open[scope] = incident
        self._rebuilt.add(incident.id)
        self._add(incident, act)
        return [incident]

    def _add(self, incident: Incident, act: StoredAct) -> None:
        """``act``'s finding among those of the incident it rebuilds."""
        assert act.finding is not None
        key = finding_key(act.finding, act.source)
        if key not in incident.findings:
            incident.findings[key] = TrackedFinding(
                self._new_id(), key, act.source, act.finding, FindingState.FIRING, act.time,
                self.clock())
        if act.finding.health.severity > incident.worst.severity:
            incident.worst = act.finding.health
        self._changed[incident.id] = incident
        self._count()

    def order_failed(self, incident_id: str, job: str) -> None:
        """The order :meth:`ordered` noted for ``job`` in the open incident ``incident_id``
        was not queued (the store failed): the incident's next finding may order the job
        (as a next leader would: it counts only the orders carried out; after an
        escalation's failed order this one also forgets the earlier order, erring towards
        one checkpoint more)."""
        for incident in self._with_id(incident_id):
            if incident.ordered.pop(job, None) is not None:
                incident.orders = max(0, incident.orders - 1)
                self._changed[incident.id] = incident

    def hold_failed(self, incident_id: str, job: str) -> None:
        """The hold :meth:`held` noted for ``job`` in the open incident ``incident_id`` was
        not queued (the store failed): the incident's next finding may hold the job (as a
        next leader would: it counts only the holds carried out)."""
        for incident in self._with_id(incident_id):
            incident.held.pop(job, None)

    def _with_id(self, incident_id: str) -> list[Incident]:
        """The open incident ``incident_id`` (none when it has ended)."""
        return [i for i in self._open.values() if i.id == incident_id]

    def close(self, finding: Finding, source: str, now: float,
              state: FindingState) -> TrackedFinding | None:
        """End the firing finding with ``finding``'s key (resolved or expired)."""
        scope, _kind = incident_scope(finding.subject)
        incident = self._open.get(scope)
        tracked = incident.findings.get(finding_key(finding, source)) if incident else None
        if incident is None or tracked is None or tracked.state != FindingState.FIRING:
            return None
        self._end(incident, tracked, state, now)
        return tracked

    def refresh(self, finding: Finding, source: str, now: float) -> None:
        """The source re-sent a firing finding (an alert's repeat): it is not silent."""
        incident = self._open.get(incident_scope(finding.subject)[0])
        tracked = incident.findings.get(finding_key(finding, source)) if incident else None
        if tracked is not None and tracked.state == FindingState.FIRING:
            tracked.last_seen = now

    def refresh_seen(self, seen: Mapping[str, float]) -> None:
        """Firing findings by key (:func:`tracked_key`) -> when their source last re-sent
        them, as another replica heard it: none of them is silent since then."""
        for incident in self._open.values():
            for tracked in incident.findings.values():
                when = seen.get(tracked.key)
                if when is not None and tracked.state == FindingState.FIRING:
                    tracked.last_seen = max(tracked.last_seen, when)

    def heard(self, liveness: str, now: float) -> None:
        """A source spoke (``agent:<node>`` for each of its batches)."""
        self._alive[liveness] = now

    def expire(self, now: float) -> list[TrackedFinding]:
        """End the firing findings whose source was silent for ``ttl_s``; returns them."""
        out = []
        for incident in list(self._open.values()):
            for tracked in list(incident.findings.values()):
                if tracked.state != FindingState.FIRING:
                    continue
                heard = max(tracked.last_seen,
                            self._alive.get(_liveness_key(tracked.source, tracked.finding), 0.0))
                if now - heard > self.ttl_s:
                    self._end(incident, tracked, FindingState.EXPIRED, now)
                    out.append(tracked)
            if incident.closed is not None and now - incident.updated > self.window_s:
                del self._open[incident.scope]
        return out

    # -- reading ---------------------------------------------------------------------------

    def incidents(self) -> list[Incident]:
        """Open incidents and those closed within the window, newest first."""
        return sorted(self._open.values(), key=lambda i: i.updated, reverse=True)

    def take_changed(self) -> list[Incident]:
        """Incidents changed since the last call (for :func:`save_incidents`)."""
        out, self._changed = list(self._changed.values()), {}
        return out

    def reload(self, rows: Iterable[dict[str, Any]], now: float) -> int:
        """Forget what this book holds and take back the open incidents in ``rows`` (a
        replica that leads again: another one decided meanwhile); returns how many."""
        self._open.clear()
        self._alive.clear()
        self._changed.clear()
        self._rebuilt.clear()
        return self.load(rows, now)

    def load(self, rows: Iterable[dict[str, Any]], now: float) -> int:
        """Take back the open incidents a previous run stored; returns how many. Their
        findings' sources get ``ttl_s`` from now to speak again."""
        n = 0
        for row in rows:
            try:
                items = json.loads(row["findings"])
                found = [(d, msgspec.convert(d["finding"], Finding)) for d in items]
            except (ValueError, KeyError, TypeError, msgspec.ValidationError):
                continue
            if not found:
                continue
            first = found[0][1]
            incident = Incident(row["id"], row["scope"], row["kind"], first.subject,
                                row["opened"], row["updated"], orders=row["orders"],
                                worst=Health(row["worst"]))
            for d, f in found:
                state = FindingState(d["state"])
                incident.findings[d["key"]] = TrackedFinding(
                    d["id"], d["key"], d["source"], f, state, d["first_seen"],
                    now if state == FindingState.FIRING else d["last_seen"], d["closed"])
            self._open[incident.scope] = incident
            n += 1
        self._count()
        return n

    # -- internals -------------------------------------------------------------------------

    def _end(self, incident: Incident, tracked: TrackedFinding, state: FindingState,
             now: float) -> None:
        tracked.state, tracked.closed = state, now
        self._m_closed.labels(state.value).inc()
        if all(t.state != FindingState.FIRING for t in incident.findings.values()):
            incident.closed = now
        self._touched(incident, now)

    def _touched(self, incident: Incident, now: float) -> None:
        incident.updated = now
        self._changed[incident.id] = incident
        self._count()

    def _count(self) -> None:
        active: dict[str, int] = dict.fromkeys(self._sources, 0)
        for incident in self._open.values():
            for t in incident.findings.values():
                if t.state == FindingState.FIRING:
                    active[t.source] = active.get(t.source, 0) + 1
        for source, n in active.items():
            self._m_active.labels(source).set(n)
        self._sources |= active.keys()
        self._m_open.set(sum(1 for i in self._open.values() if i.closed is None))


_UPSERT = (
    "INSERT INTO incidents (id, scope, kind, node, gpu, job, state, health, worst, checks,"
    " opened, updated, closed, orders, findings) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
    " ON CONFLICT (id) DO UPDATE SET state = excluded.state, health = excluded.health,"
    " worst = excluded.worst, checks = excluded.checks, updated = excluded.updated,"
    " closed = excluded.closed, orders = excluded.orders, findings = excluded.findings"
)


def save_incidents(store: StateStore, incidents: Iterable[Incident]) -> None:
    """Write ``incidents`` to the store's ``incidents`` table (one transaction)."""
    rows = [i.row() for i in incidents]
    if rows:
        with store.write() as conn:
            conn.executemany(_UPSERT, rows)
