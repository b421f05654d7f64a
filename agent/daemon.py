"""The agent daemon: poll the GPU source on a ticker, run the checks, publish metrics.

:class:`Agent` is built from its parts (config, GPU backend, extra XID sources, checks,
clocks) so tests inject every one of them; :func:`main` builds the real ones for the
``forewarn agent`` command.

One poll cycle (:meth:`Agent.poll_once`): sample every GPU, drain XID events (the
backend's own and the kernel log's, bus ids mapped to GPU indexes, duplicates across
sources dropped), run the checks, update the table of current findings and record which
changed or escalated (transitions), publish an immutable snapshot to the exporter (a scrape
costs no NVML call), then hand the cycle to every component. A source that fails is logged,
counted, marked down and retried later; the daemon never dies of bad data.

Components (plug-in interface)
------------------------------
Other parts of the agent (rank ingest, collector uplink) plug in as *components*: any
object with a ``name`` attribute and any of these methods (all optional)::

    class MyComponent:
        name = "ranks"

        def start(self, agent: Agent) -> None:
            # called once by Agent.start(), after the registry and the exporter exist and
            # before the first poll. Register Prometheus collectors here:
            #     agent.registry.register(my_collector)
            # and start your own threads. agent.config is the AgentConfig.
            ...

        def on_poll(self, poll: Poll) -> None:
            # called on the poll thread after every cycle with this cycle's samples, XIDs,
            # findings and transitions. Keep it short (no blocking I/O): hand work to
            # your own thread. Exceptions are logged and counted, never fatal.
            ...

        def stop(self) -> None:
            # called once at shutdown, in reverse order of start.
            ...

        def readiness(self) -> dict[str, Any]:
            # /readyz (any thread): {"ready": bool, "detail": str, ...}, reported under
            # the component's ``ready_name`` (default ``name``). A component whose start
            # raised is reported not ready with the error.
            ...

Add one with :meth:`Agent.add_component` before :meth:`Agent.start`. For the
``forewarn agent`` command, list the component's factory in :data:`COMPONENTS`: a
``(module, function)`` pair where ``function(config: AgentConfig) -> component | None``
(None: disabled by config). Components may publish their own findings (e.g. a rank hang)
with :meth:`Agent.submit_findings` from any thread: they join the findings table at once
(``/api/v1/findings``, ``forewarn_finding_active``) and their transitions are delivered
in the next poll's ``transitions``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import msgspec

from forewarn import __version__
from forewarn.agent.backend import GpuBackend, SourceUnavailable, XidSource
from forewarn.agent.checks.base import Check, CheckRun, run_checks
from forewarn.agent.config import AgentConfig
from forewarn.agent.exporter import AgentExporter, MetricsServer, Snapshot, SourceStatus
from forewarn.agent.sdnotify import Notifier
from forewarn.agent.state import AgentState
from forewarn.config import ConfigError
from forewarn.escalation import escalates
from forewarn.gpu import classify_xid
from forewarn.labels import BoundedLabelsRegistry
from forewarn.wire import Finding, GpuSample, Health, SuggestedAction, XidEvent

__all__ = [
    "COMPONENTS",
    "Agent",
    "Component",
    "Poll",
    "Transition",
    "build_backend",
    "build_xid_sources",
    "main",
]

log = logging.getLogger(__name__)

COMPONENTS: tuple[tuple[str, str], ...] = (
    ("forewarn.agent.rank_component", "build"),  # training ranks: socket, orders, hangs
    ("forewarn.agent.uplink", "build"),  # collector uplink: spool, batches, commands
)
"""``(module, factory)`` of every optional component ``forewarn agent`` starts, in order.
``factory(config: AgentConfig)`` returns the component or None when config disables it."""

XID_DEDUP_S = 5.0
"""The same XID (GPU, code) reported by two sources (NVML event set and kernel log)
within this many seconds is counted once."""


class Component(Protocol):
    """A part of the agent written elsewhere; see the module docstring. Only ``name`` is
    required; ``start(agent)``, ``on_poll(poll)`` and ``stop()`` are optional."""

    name: str


@dataclasses.dataclass(frozen=True)
class Transition:
    """A finding whose health or suggested action changed, that is new, or whose evidence
    grew materially worse than when it was last reported (:mod:`forewarn.escalation`)."""

    previous: Health | None
    """Health before; None when the check had not judged this subject before."""
    previous_action: SuggestedAction | None
    finding: Finding


@dataclasses.dataclass(frozen=True)
class Poll:
    """One poll cycle, handed to every component's ``on_poll``."""

    time: float
    samples: tuple[GpuSample, ...]
    xids: tuple[XidEvent, ...]
    """New XID events of this cycle (bus ids mapped to GPUs, cross-source duplicates dropped)."""
    findings: tuple[Finding, ...]
    """Every finding the checks returned this cycle (healthy ones too)."""
    transitions: tuple[Transition, ...]
    check_runs: tuple[CheckRun, ...]


@dataclasses.dataclass
class _SourceHealth:
    name: str
    up: bool = False
    opened: bool = False
    poll_seconds: float = 0.0
    errors: int = 0
    retry_at: float = 0.0
    last_error: str = ""


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
        self.xid_sources = list(xid_sources)
        self.checks = list(checks)
        self.clock = clock
        self.monotonic = monotonic
        self.timer = timer
        self.notifier = notifier if notifier is not None else Notifier()
        self.retry_s = retry_s
        self.state = AgentState(node=config.node)
        self.registry = BoundedLabelsRegistry()
        """The agent's registry: components register their own collectors here. Label
        values are bounded and made valid UTF-8 at scrape time (:mod:`forewarn.labels`)."""
        self.exporter = AgentExporter(config.node, version)
        self.registry.register(self.exporter)
        if process_metrics:
            from prometheus_client import ProcessCollector

            ProcessCollector(namespace="forewarn_agent", registry=self.registry)
        self.server: MetricsServer | None = None
        self.components: list[Any] = []
        self._started: list[Any] = []
        self._source = _SourceHealth(backend.name)
        self._xid_health = {name: _SourceHealth(name, up=True, opened=True)
                            for name, _ in self.xid_sources}
        self._lock = threading.Lock()
        self._findings: dict[tuple[str, str], Finding] = {}
        self._reported: dict[tuple[str, str], Finding] = {}
        """The finding of each key last reported as a transition (the escalation base)."""
        self._pending: list[Transition] = []
        self._xid_counts: Counter[tuple[str, int, str]] = Counter()
        self._field_errors: Counter[tuple[int, str]] = Counter()
        self._transition_counts: Counter[tuple[str, str]] = Counter()
        self._recent_xids: list[XidEvent] = []
        self._polls = 0
        self._last_poll_mono: float | None = None
        self._component_errors = 0
        self._failed_start: dict[str, str] = {}
        """ready_name -> why the component did not start (for /readyz)."""

    # -- lifecycle -----------------------------------------------------------------------

    def add_component(self, component: Any) -> None:
        """Plug in a component (see the module docstring); call before :meth:`start`."""
        self.components.append(component)

    def start(self, serve: bool = True) -> None:
        """Open the source (a failure is logged and retried), start the HTTP server on
        ``config.listen`` (when ``serve``) and the components."""
        self._open_backend()
        if serve:
            host, _, port = self.config.listen.rpartition(":")
            self.server = MetricsServer(
                self.registry, host.strip("[]"), int(port),
                healthy=self._healthz, findings=self.current_findings, ready=self.readiness,
            )
            self.server.start()
            log.info("serving /metrics on http://%s:%d", *self.server.address)
        for comp in self.components:
            start = getattr(comp, "start", None)
            try:
                if start is not None:
                    start(self)
                self._started.append(comp)
            except Exception as exc:
                log.exception("component %s failed to start; running without it",
                              getattr(comp, "name", comp))
                self._failed_start[_ready_name(comp)] = f"failed to start: {exc}"

    def stop(self) -> None:
        """Stop components (reverse order), the HTTP server, and close the sources."""
        for comp in reversed(self._started):
            stop = getattr(comp, "stop", None)
            if stop is not None:
                try:
                    stop()
                except Exception:
                    log.exception("component %s failed to stop", getattr(comp, "name", comp))
        self._started.clear()
        if self.server is not None:
            self.server.close()
            self.server = None
        for closer in [self.backend.close, *(xs.close for _, xs in self.xid_sources)]:
            try:
                closer()
            except Exception:
                log.exception("closing a source failed")

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
                    self.notifier.ready(self._status_line(poll))
                    ready = True
                elif self.config.watchdog and poll.transitions:
                    self.notifier.status(self._status_line(poll))
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
        samples = self._poll_backend(now)
        self.state.add_samples(samples)
        for s in samples:
            for err in s.errors:
                self._field_errors[(s.gpu, err.split(":", 1)[0].strip())] += 1
        xids = self._drain_xids(now)
        self.state.add_xids(xids, now)
        for ev in xids:
            c = classify_xid(ev.code)
            self._xid_counts[("" if ev.gpu is None else str(ev.gpu), ev.code, c.cls)] += 1
        runs = run_checks(self.checks, self.state, now, timer=self.timer)
        transitions: list[Transition] = []
        with self._lock:
            for run in runs:
                transitions.extend(self._update_findings(run.name, run.findings, now))
            transitions = self._pending + transitions
            self._pending = []
            findings_now = tuple(self._findings.values())
        for t in transitions:
            self._transition_counts[(t.finding.check, t.finding.health.value)] += 1
            if t.finding.health != Health.HEALTHY or t.previous not in (None, Health.HEALTHY):
                log.warning("%s %s: %s -> %s (%s): %s", t.finding.check, t.finding.subject.key(),
                            t.previous.value if t.previous else "new", t.finding.health.value,
                            t.finding.action.value, t.finding.reason)
        self._polls += 1
        self._last_poll_mono = self.monotonic()
        self.exporter.publish(Snapshot(
            node=self.config.node,
            time=now,
            samples=tuple(h.last for _, h in sorted(self.state.gpus.items()) if h.last),
            findings=findings_now,
            check_runs=tuple(runs),
            sources=(self._status(self._source),),
            xid_sources=tuple(
                self._status(self._xid_health[name], getattr(xs, "skipped", 0))
                for name, xs in self.xid_sources
            ),
            xid_counts=dict(self._xid_counts),
            field_errors=dict(self._field_errors),
            transitions=dict(self._transition_counts),
            polls_total=self._polls,
            simulated=bool(getattr(self.backend, "simulated", False)),
        ))
        poll = Poll(
            time=now,
            samples=tuple(samples),
            xids=tuple(xids),
            findings=tuple(f for run in runs for f in run.findings),
            transitions=tuple(transitions),
            check_runs=tuple(runs),
        )
        for comp in self._started:
            on_poll = getattr(comp, "on_poll", None)
            if on_poll is None:
                continue
            try:
                on_poll(poll)
            except Exception:
                self._component_errors += 1
                log.exception("component %s failed in on_poll", getattr(comp, "name", comp))
        return poll

    def submit_findings(self, findings: Iterable[Finding], *, check: str | None = None) -> None:
        """Publish findings from a component (any thread). With ``check``, ``findings`` is
        that check's complete current judgement: its subjects not listed are dropped."""
        items = list(findings)
        now = self.clock()
        with self._lock:
            if check is not None:
                self._pending.extend(self._update_findings(check, items, now))
            else:
                for name in sorted({f.check for f in items}):
                    self._pending.extend(self._update_findings(
                        name, [f for f in items if f.check == name], now, drop_missing=False))

    def current_findings(self) -> list[Finding]:
        """Every current finding (thread-safe copy), worst first."""
        rank = {Health.UNHEALTHY: 0, Health.DEGRADED: 1, Health.UNKNOWN: 2, Health.HEALTHY: 3}
        with self._lock:
            items = list(self._findings.values())
        return sorted(items, key=lambda f: (rank[f.health], f.subject.key(), f.check))

    @property
    def address(self) -> tuple[str, int] | None:
        """Where /metrics is served (host, port), once started."""
        return self.server.address if self.server is not None else None

    # -- internals -----------------------------------------------------------------------

    def _update_findings(
        self, check: str, findings: Iterable[Finding], now: float, drop_missing: bool = True
    ) -> list[Transition]:
        out = []
        seen = set()
        for f in findings:
            key = (f.check, f.subject.key())
            seen.add(key)
            old = self._findings.get(key)
            self._findings[key] = f
            reported = self._reported.get(key)
            if (old is None or old.health != f.health or old.action != f.action
                    or (reported is not None and escalates(reported, f))):
                # Materially worse evidence under the same health (remapped rows growing
                # under "remap pending") is re-reported too: forewarn.escalation.
                out.append(Transition(old.health if old else None,
                                      old.action if old else None, f))
                self._reported[key] = f
        if drop_missing:
            for key in [k for k in self._findings if k[0] == check and k not in seen]:
                old = self._findings.pop(key)
                self._reported.pop(key, None)
                if old.health != Health.HEALTHY:
                    cleared = msgspec.structs.replace(
                        old, health=Health.UNKNOWN, action=SuggestedAction.NONE, time=now,
                        reason=f"{check} no longer judges this subject (was: {old.reason})"[:4000],
                    )
                    out.append(Transition(old.health, old.action, cleared))
        return out

    def _open_backend(self) -> None:
        src = self._source
        try:
            inventory = self.backend.open()
        except SourceUnavailable as exc:
            self._source_failed(f"cannot open: {exc}")
            return
        except Exception as exc:  # a source bug must not kill the daemon either
            log.exception("source %s failed to open", src.name)
            self._source_failed(f"cannot open: {type(exc).__name__}: {exc}")
            return
        self.state.add_inventory(inventory)
        src.opened = True
        src.up = True
        log.info("source %s: %d GPU(s)", src.name, len(inventory))

    def _source_failed(self, message: str) -> None:
        src = self._source
        if src.up or message != src.last_error:
            log.error("source %s: %s (retrying every %gs)", src.name, message, self.retry_s)
        src.up = False
        src.errors += 1
        src.last_error = message
        src.retry_at = self.monotonic() + self.retry_s

    def _poll_backend(self, now: float) -> list[GpuSample]:
        src = self._source
        if not src.opened:
            if self.monotonic() < src.retry_at:
                return []
            self._open_backend()
            if not src.opened:
                return []
        start = self.timer()
        try:
            samples = list(self.backend.sample(now))
        except SourceUnavailable as exc:
            src.opened = False
            try:
                self.backend.close()
            except Exception:
                log.debug("close after failure raised", exc_info=True)
            self._source_failed(f"became unavailable: {exc}")
            return []
        except Exception as exc:
            log.exception("source %s failed to sample", src.name)
            src.errors += 1
            src.up = False
            src.last_error = f"{type(exc).__name__}: {exc}"
            return []
        finally:
            src.poll_seconds = self.timer() - start
        if not src.up:
            log.info("source %s is back", src.name)
        src.up = True
        return samples

    def _drain_xids(self, now: float) -> list[XidEvent]:
        batches: list[tuple[str, list[XidEvent]]] = []
        if self._source.opened:
            try:
                batches.append((self._source.name, list(self.backend.drain_xids())))
            except Exception as exc:
                log.warning("source %s: draining XIDs failed: %s", self._source.name, exc)
        for name, xs in self.xid_sources:
            health = self._xid_health[name]
            try:
                batches.append((name, list(xs.drain())))
                health.up = True
            except Exception as exc:
                if health.up:
                    log.warning("XID source %s failed: %s", name, exc)
                health.up = False
                health.errors += 1
        out: list[XidEvent] = []
        self._recent_xids = [e for e in self._recent_xids if e.time >= now - 60.0]
        for _name, events in batches:
            for ev in events:
                if ev.gpu is None and ev.pci_bus_id:
                    gpu = self.state.gpu_for_bus_id(ev.pci_bus_id)
                    if gpu is not None:
                        ev = msgspec.structs.replace(ev, gpu=gpu)
                if any(r.gpu == ev.gpu and r.code == ev.code and r.source != ev.source
                       and abs(r.time - ev.time) <= XID_DEDUP_S for r in self._recent_xids):
                    continue
                self._recent_xids.append(ev)
                out.append(ev)
        return out

    def _status(self, src: _SourceHealth, skipped: int = 0) -> SourceStatus:
        return SourceStatus(name=src.name, up=src.up, poll_seconds=src.poll_seconds,
                            errors_total=src.errors, skipped_total=skipped,
                            last_error=src.last_error)

    def _healthz(self) -> tuple[bool, str]:
        last = self._last_poll_mono
        if last is None:
            return False, "no poll yet"
        age = self.monotonic() - last
        limit = 3 * self.config.interval_s + 5.0
        if age > limit:
            return False, f"last poll {age:.1f}s ago (limit {limit:.1f}s)"
        return True, f"ok: source {self._source.name} {'up' if self._source.up else 'down'}"

    def readiness(self) -> dict[str, Any]:
        """``/readyz``: liveness of the poll loop, the source, the checks and every
        component (rank socket, uplink with its spool depth); ready when all are."""
        live, detail = self._healthz()
        src = self._source
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
            report = getattr(comp, "readiness", None)
            if report is not None:
                try:
                    parts[_ready_name(comp)] = report()
                except Exception as exc:  # a report must not break /readyz
                    parts[_ready_name(comp)] = {"ready": False, "detail": f"error: {exc!r}"}
        for name, why in self._failed_start.items():
            parts[name] = {"ready": False, "detail": why}
        return {"ready": all(p["ready"] for p in parts.values()), "service": "agent",
                "node": self.config.node, "components": parts}

    def _status_line(self, poll: Poll) -> str:
        with self._lock:
            bad = [f for f in self._findings.values() if f.health != Health.HEALTHY]
        return (f"{len(self.state.gpus)} GPU(s) via {self._source.name} "
                f"({'up' if self._source.up else 'down'}), {len(bad)} finding(s) not healthy")


def _ready_name(comp: Any) -> str:
    return str(getattr(comp, "ready_name", getattr(comp, "name", type(comp).__name__)))


# -- building the real parts -------------------------------------------------------------


def _source_class(module: str, name: str) -> Any:
    """Import a source class lazily (only the nvml module imports pynvml, and only when
    that source is chosen)."""
    return getattr(importlib.import_module(f"forewarn.agent.sources.{module}"), name)


def build_backend(config: AgentConfig) -> GpuBackend:
    """The GPU source named by ``config.source`` (``auto`` = nvml).

    Raises :class:`ConfigError` for a missing setting and :class:`SourceUnavailable`
    (e.g. ``ScenarioError``) for a bad scenario file.
    """
    source = "nvml" if config.source == "auto" else config.source
    backend: GpuBackend
    if source == "nvml":
        backend = _source_class("nvml", "NvmlBackend")(node=config.node)
    elif source == "sim":
        sim = importlib.import_module("forewarn.agent.sources.sim")
        # A bad scenario file raises ScenarioError (a SourceUnavailable naming the key).
        scenario = sim.load_scenario(config.scenario) if config.scenario is not None else None
        backend = sim.SimBackend(scenario, node=config.node, gpus=config.sim_gpus,
                                 speed=config.sim_speed)
    elif source == "replay":
        if config.replay_path is None:
            raise ConfigError("replay_path: required with source = replay (--replay FILE)")
        backend = _source_class("replay", "ReplayBackend")(
            path=config.replay_path, node=config.node, speed=config.replay_speed)
    elif source == "dcgm":
        backend = _source_class("dcgm", "DcgmBackend")(
            url=config.dcgm_url, node=config.node, timeout_s=config.dcgm_timeout_s)
    else:
        raise ConfigError(f"source: unknown source {config.source!r}")
    return backend


def build_xid_sources(config: AgentConfig) -> list[tuple[str, XidSource]]:
    """The kernel-log XID source when enabled and readable; otherwise a warning and none
    (the agent keeps running: NVML's event set still reports XIDs)."""
    if not config.kmsg or config.source in ("sim", "replay"):
        return []
    try:
        kmsg = _source_class("kmsg", "KmsgXidSource")(path=config.kmsg_path, node=config.node)
    except (OSError, SourceUnavailable) as exc:
        log.warning("cannot read XIDs from %s (%s): run as root or with CAP_SYSLOG, or pass "
                    "--no-kmsg; continuing without the kernel log", config.kmsg_path, exc)
        return []
    return [("kmsg", kmsg)]


def main(config: AgentConfig) -> int:
    """Run the agent of ``config`` until SIGTERM/SIGINT (``forewarn agent``, which loads
    the config and sets up logging). Exit 2 on a configuration error."""
    try:
        backend = build_backend(config)
    except ConfigError as exc:
        print(f"forewarn agent: config error: {exc}", file=sys.stderr)
        return 2
    except (SourceUnavailable, ValueError) as exc:
        print(f"forewarn agent: {exc}", file=sys.stderr)
        return 2
    if config.source in ("sim", "replay"):
        # A scenario or replay file the user named: a bad one is a config error, said now.
        try:
            backend.open()
            backend.close()
        except SourceUnavailable as exc:
            print(f"forewarn agent: {config.source} source: {exc}", file=sys.stderr)
            return 2
    agent = Agent(config, backend, xid_sources=build_xid_sources(config),
                  process_metrics=True)
    for module, factory in COMPONENTS:
        try:
            comp = getattr(importlib.import_module(module), factory)(config)
        except ConfigError as exc:
            print(f"forewarn agent: config error: {exc}", file=sys.stderr)
            return 2
        if comp is not None:
            agent.add_component(comp)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.start()
    except OSError as exc:
        print(f"forewarn agent: cannot listen on {config.listen}: {exc}", file=sys.stderr)
        agent.stop()
        return 1
    try:
        agent.run(stop)
    finally:
        agent.stop()
    return 0
