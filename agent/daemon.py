"""The agent daemon: poll the GPU source on a ticker, run the checks, publish metrics.

:class:`Agent` is built from its parts (config, GPU backend, extra XID sources, checks,
components, clocks) so tests inject every one of them; :mod:`forewarn.agent.build` builds
the real ones and :mod:`forewarn.agent.cli` runs them for the ``forewarn agent`` command.

One poll cycle (:meth:`Agent.poll_once`): sample every GPU and drain XID events
(:mod:`forewarn.agent.source_runner`: the backend's own and the kernel log's, bus ids mapped
to GPU indexes, duplicates across sources dropped), run the checks, update the table of
current findings and record which changed or escalated (:mod:`forewarn.agent.findings`),
publish an immutable snapshot to the exporter (a scrape costs no NVML call), then hand the
cycle to every component (:class:`forewarn.agent.protocols.Component`, added with
:meth:`Agent.add_component` before :meth:`Agent.start`). A source that fails is logged,
counted, marked down and retried later; the daemon never dies of bad data.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from forewarn import __version__
from forewarn.agent.backend import GpuBackend, XidSource
from forewarn.agent.checks.base import Check, CheckRun, run_checks
from forewarn.agent.config import AgentConfig
from forewarn.agent.exporter import AgentExporter, Snapshot
from forewarn.agent.findings import FindingsTable
from forewarn.agent.metrics_server import MetricsServer
from forewarn.agent.protocols import Component, Poll, Transition
from forewarn.agent.sdnotify import Notifier
from forewarn.agent.source_runner import SourceRunner
from forewarn.agent.state import AgentState
from forewarn.gpu import classify_xid
from forewarn.labels import BoundedLabelsRegistry
from forewarn.wire import Finding, GpuSample, Health, XidEvent

__all__ = ["Agent"]

log = logging.getLogger(__name__)


class Agent:
    """The node agent. See the module docstring for the poll cycle and components.

    Args:
        config: the agent's configuration.
        backend: the GPU source (opened by :meth:`start`, retried when it fails).
        xid_sources: extra XID sources (the kernel log).
        checks: the checks to run each cycle (default: ``ALL_CHECKS`` with defaults).
        clock: wall clock for sample and finding times (default ``time.time``).
        monotonic: clock for the ticker and retry timing (default ``time.monotonic``).
        timer: duration timer for self-metrics (default ``time.perf_counter``).
        notifier: systemd notifier (default: from the environment).
        retry_s: seconds between attempts to (re)open a failed source.
        process_metrics: also export process CPU/memory (prometheus_client's collector).
    """

    def __init__(
        self,
        config: AgentConfig,
        backend: GpuBackend,
        *,
        xid_sources: Sequence[tuple[str, XidSource]] = (),
        checks: Sequence[Check] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        notifier: Notifier | None = None,
        retry_s: float = 10.0,
        process_metrics: bool = False,
        version: str = __version__,
    ) -> None:
        if checks is None:
            from forewarn.agent.checks import default_checks

            checks = default_checks()
        self.config = config
        self.backend = backend
        self.checks = list(checks)
        self.clock = clock
        self.monotonic = monotonic
        self.timer = timer
        self.notifier = notifier if notifier is not None else Notifier()
        self.state = AgentState(node=config.node)
        self.sources = SourceRunner(backend, xid_sources, self.state, retry_s=retry_s,
                                    monotonic=monotonic, timer=timer)
        self.registry = BoundedLabelsRegistry()
        """The agent's registry: components register their own collectors here. Label
        values are bounded and made valid UTF-8 at scrape time (:mod:`forewarn.labels`)."""
        self.exporter = AgentExporter(config.node, version)
        self.registry.register(self.exporter)
        if process_metrics:
            from prometheus_client import ProcessCollector

            ProcessCollector(namespace="forewarn_agent", registry=self.registry)
        self.server: MetricsServer | None = None
        self.components: list[Component] = []
        self._started: list[Component] = []
        self.findings = FindingsTable()
        self._xid_counts: Counter[tuple[str, int, str]] = Counter()
        self._field_errors: Counter[tuple[int, str]] = Counter()
        self._transition_counts: Counter[tuple[str, str]] = Counter()
        self._polls = 0
        self._last_poll_mono: float | None = None
        self._component_errors = 0
        self._failed_start: dict[str, str] = {}
        """ready_name -> why the component did not start (for /readyz)."""

    # -- lifecycle -----------------------------------------------------------------------

    def add_component(self, component: Component) -> None:
        """Plug in a component (:class:`~forewarn.agent.protocols.Component`); call before
        :meth:`start`."""
        self.components.append(component)

    def start(self, serve: bool = True) -> None:
        """Open the source (a failure is logged and retried), start the HTTP server on
        ``config.listen`` (when ``serve``) and the components."""
        self.sources.open()
        if serve:
            host, _, port = self.config.listen.rpartition(":")
            self.server = MetricsServer(
                self.registry, host.strip("[]"), int(port),
                healthy=self._healthz, findings=self.current_findings, ready=self.readiness,
            )
            self.server.start()
            log.info("serving /metrics on http://%s:%d", *self.server.address)
        for comp in self.components:
            try:
                comp.start(self)
                self._started.append(comp)
            except Exception as exc:
                log.exception("component %s failed to start; running without it", comp.name)
                self._failed_start[comp.ready_name] = f"failed to start: {exc}"

    def stop(self) -> None:
        """Stop components (reverse order), the HTTP server, and close the sources."""
        for comp in reversed(self._started):
            try:
                comp.stop()
            except Exception:
                log.exception("component %s failed to stop", comp.name)
        self._started.clear()
        if self.server is not None:
            self.server.close()
            self.server = None
        self.sources.close()

    def run(self, stop: threading.Event) -> None:
        """Poll every ``config.interval_s`` on a monotonic ticker until ``stop`` is set.

        Ticks stay on the grid ``start + k * interval`` (no drift); a cycle that overran
        skips the ticks it missed. sd_notify READY follows the first poll, WATCHDOG pings
        go out at half of ``$WATCHDOG_USEC`` from this loop.
        """
        interval = self.config.interval_s
        watchdog = self.notifier.watchdog_interval_s if self.config.watchdog else None
        next_poll = self.monotonic()
        next_ping = next_poll
        ready = False
        while not stop.is_set():
            now = self.monotonic()
            if now >= next_poll:
                poll = self.poll_once()
                next_poll += interval
                late = self.monotonic() - next_poll
                if late >= 0:
                    next_poll += (math.floor(late / interval) + 1) * interval
                if not ready and self.config.watchdog:
                    self.notifier.ready(self._status_line())
                    ready = True
                elif self.config.watchdog and poll.transitions:
                    self.notifier.status(self._status_line())
            if watchdog is not None and self.monotonic() >= next_ping:
                self.notifier.watchdog()
                next_ping = self.monotonic() + watchdog
            deadline = min(next_poll, next_ping) if watchdog is not None else next_poll
            stop.wait(max(0.0, deadline - self.monotonic()))
        if self.config.watchdog:
            self.notifier.stopping()

    # -- one cycle -----------------------------------------------------------------------

    def poll_once(self) -> Poll:
        """Run one poll cycle (see the module docstring) and return what it saw."""
        now = self.clock()
        samples = self.sources.sample(now)
        self.state.add_samples(samples)
        xids = self.sources.drain_xids(now)
        self.state.add_xids(xids, now)
        self._count(samples, xids)
        runs = run_checks(self.checks, self.state, now, timer=self.timer)
        transitions, findings_now = self.findings.update(
            ((run.name, run.findings) for run in runs), now)
        self._note_transitions(transitions)
        self._polls += 1
        self._last_poll_mono = self.monotonic()
        self._publish(now, findings_now, runs)
        poll = Poll(
            time=now,
            samples=tuple(samples),
            xids=tuple(xids),
            findings=tuple(f for run in runs for f in run.findings),
            transitions=tuple(transitions),
            check_runs=tuple(runs),
        )
        for comp in self._started:
            try:
                comp.on_poll(poll)
            except Exception:
                self._component_errors += 1
                log.exception("component %s failed in on_poll", comp.name)
        return poll

    def submit_findings(self, findings: Iterable[Finding], *, check: str | None = None) -> None:
        """Publish findings from a component (any thread). With ``check``, ``findings`` is
        that check's complete current judgement: its subjects not listed are dropped."""
        self.findings.submit(findings, self.clock(), check=check)

    def current_findings(self) -> list[Finding]:
        """Every current finding (thread-safe copy), worst first."""
        return self.findings.current()

    @property
    def address(self) -> tuple[str, int] | None:
        """Where /metrics is served (host, port), once started."""
        return self.server.address if self.server is not None else None

    # -- internals -----------------------------------------------------------------------

    def _count(self, samples: list[GpuSample], xids: list[XidEvent]) -> None:
        """Self-metrics: field read errors per GPU and field, XIDs per GPU, code, class."""
        for s in samples:
            for err in s.errors:
                self._field_errors[(s.gpu, err.split(":", 1)[0].strip())] += 1
        for ev in xids:
            c = classify_xid(ev.code)
            self._xid_counts[("" if ev.gpu is None else str(ev.gpu), ev.code, c.cls)] += 1

    def _note_transitions(self, transitions: list[Transition]) -> None:
        """Count every transition; log those to or from a health that is not healthy."""
        for t in transitions:
            self._transition_counts[(t.finding.check, t.finding.health.value)] += 1
            if t.finding.health != Health.HEALTHY or t.previous not in (None, Health.HEALTHY):
                log.warning("%s %s: %s -> %s (%s): %s", t.finding.check, t.finding.subject.key(),
                            t.previous.value if t.previous else "new", t.finding.health.value,
                            t.finding.action.value, t.finding.reason)

    def _publish(self, now: float, findings: tuple[Finding, ...], runs: list[CheckRun]) -> None:
        """Hand the exporter this cycle's snapshot (scrapes read only that)."""
        sources, xid_sources = self.sources.statuses()
        self.exporter.publish(Snapshot(
            node=self.config.node,
            time=now,
            samples=tuple(h.last for _, h in sorted(self.state.gpus.items()) if h.last),
            findings=findings,
            check_runs=tuple(runs),
            sources=sources,
            xid_sources=xid_sources,
            xid_counts=dict(self._xid_counts),
            field_errors=dict(self._field_errors),
            transitions=dict(self._transition_counts),
            polls_total=self._polls,
            simulated=self.backend.simulated,
        ))

    def _healthz(self) -> tuple[bool, str]:
        last = self._last_poll_mono
        if last is None:
            return False, "no poll yet"
        age = self.monotonic() - last
        limit = 3 * self.config.interval_s + 5.0
        if age > limit:
            return False, f"last poll {age:.1f}s ago (limit {limit:.1f}s)"
        src = self.sources.health
        return True, f"ok: source {src.name} {'up' if src.up else 'down'}"

    def readiness(self) -> dict[str, Any]:
        """``/readyz``: liveness of the poll loop, the source, the checks and every
        component (rank socket, uplink with its spool depth); ready when all are."""
        live, detail = self._healthz()
        src = self.sources.health
        parts: dict[str, dict[str, Any]] = {
            "poll": {"ready": live, "detail": detail},
            "source": {"ready": src.opened and src.up,
                       "detail": f"{src.name}: " + ("up" if src.opened and src.up
                                                    else src.last_error or "not polled yet")},
        }
        runs = self.exporter.snapshot.check_runs
        failing = sorted(r.name for r in runs if not r.ok)
        parts["checks"] = {
            "ready": bool(runs) and not failing,
            "detail": (f"failing: {', '.join(failing)}" if failing
                       else f"{len(runs)} ran" if runs else "not run yet")}
        for comp in self._started:
            try:
                report = comp.readiness()
            except Exception as exc:  # a report must not break /readyz
                report = {"ready": False, "detail": f"error: {exc!r}"}
            if report is not None:
                parts[comp.ready_name] = report
        for name, why in self._failed_start.items():
            parts[name] = {"ready": False, "detail": why}
        return {"ready": all(p["ready"] for p in parts.values()), "service": "agent",
                "node": self.config.node, "components": parts}

    def _status_line(self) -> str:
        src = self.sources.health
        return (f"{len(self.state.gpus)} GPU(s) via {src.name} "
                f"({'up' if src.up else 'down'}), {self.findings.not_healthy()} finding(s) "
                "not healthy")
