"""The agent component that hears the training ranks and acts on what it hears.

A :class:`~forewarn.agent.protocols.Component` of :class:`forewarn.agent.daemon.Agent`:

* ``start``: puts its :class:`~forewarn.agent.ranks.RankTable` into ``agent.state.ranks``
  (the rank checks in ``ALL_CHECKS`` read it), registers :class:`RankCollector`, binds the
  socket and starts the ingest thread and the hang watcher;
* at datagram arrival (ingest thread): a NaN/Inf or a grad-norm spike becomes a finding at
  once (``agent.submit_findings``), and a spike orders a checkpoint (fast path) — well
  within a poll interval of the bad step;
* hang watcher thread: wakes at the earliest hang deadline of any rank (not only on the
  poll ticker), so a hang is reported within milliseconds of its timeout;
* preemption notice in a beat (ingest thread): the job's save order
  (``orders.preempt_job``), unless the SIGTERM was the hang terminator's own;
* ``on_poll``: the local fast path for critical GPU/node findings, hang confirmation and
  termination, order retries, eviction of silent ranks.

``forewarn agent`` hands the collector uplink ``component.table`` (its
:class:`~forewarn.agent.protocols.RankFeed`: summaries and checkpoint reports going up) and
``component.orders`` (its :class:`~forewarn.agent.protocols.OrderSink`: the collector's
orders, holds and advice coming down): :func:`forewarn.agent.build.build_components`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forewarn.agent.checks.grad_spike import judge_spike
from forewarn.agent.checks.nan_loss import judge_nan
from forewarn.agent.checks.rank_hang import RankHangCheck, hang_deadline, hang_timeout
from forewarn.agent.config import AgentConfig
from forewarn.agent.hang import HangTerminator
from forewarn.agent.ingest import RankIngest
from forewarn.agent.orders import CheckpointOrders
from forewarn.agent.procview import ProcView
from forewarn.agent.protocols import AgentHost, ComponentBase, Poll
from forewarn.agent.rank_metrics import RankCollector
from forewarn.agent.rank_state import RankView, by_job
from forewarn.agent.ranks import RankLimits, RankTable
from forewarn.agent.socket_queue import PROC_PATH
from forewarn.wire import Finding, Health, StepRecord

__all__ = ["RankComponent"]

log = logging.getLogger(__name__)


class RankComponent(ComponentBase):
    """Rank ingest, fast detectors, checkpoint orders and hang handling for one agent."""

    name = "ranks"
    ready_name = "rank_socket"

    def __init__(
        self,
        config: AgentConfig,
        *,
        proc: ProcView | None = None,
        clock: Callable[[], float] = time.time,
        qlen_path: Path = PROC_PATH,
    ) -> None:
        self.config = config
        self.clock = clock
        self.table = RankTable(RankLimits(hang_floor_s=config.hang_floor_s),
                               proc=proc, spike_factor=config.grad_spike_factor)
        self.ingest = RankIngest(self.table, config.socket_path,
                                 mode=int(config.socket_mode, 8),
                                 group=config.socket_group or None, clock=clock,
                                 qlen_path=qlen_path)
        self.orders = CheckpointOrders(self.table, self.ingest.send,
                                       safety_s=config.order_safety_s, clock=clock)
        self.terminator = HangTerminator(self.table, action=config.hang_action,
                                         grace_s=config.hang_grace_s)
        self.agent: AgentHost | None = None
        self._hang = RankHangCheck()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._idle = False
        """The hang watcher sleeps until kicked (no rank known)."""
        self._watcher: threading.Thread | None = None
        self.table.on_step(self._on_step)
        self.table.on_preempt(self._on_preempt)

    # -- component interface -------------------------------------------------------------
    def start(self, agent: AgentHost) -> None:
        self.agent = agent
        agent.state.ranks = self.table
        agent.registry.register(RankCollector(
            self.config.node, self.table, ingest=self.ingest, orders=self.orders,
            terminator=self.terminator, clock=self.clock))
        self.ingest.start()
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch_hangs, name="forewarn-hang-watch",
                                         daemon=True)
        self._watcher.start()
        log.info("listening for training ranks on %s", self.config.socket_path)

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        self.ingest.stop()
        self.terminator.close()

    def readiness(self) -> dict[str, Any]:
        """Ready while the socket is bound and its receive thread runs; a low
        ``net.unix.max_dgram_qlen`` is shown, not a reason to be unready."""
        bound = self.ingest.listening
        limit = self.ingest.queue_limit
        report: dict[str, Any] = {
            "ready": bound, "socket": str(self.config.socket_path),
            "detail": f"{'listening on' if bound else 'not listening on'} "
                      f"{self.config.socket_path}"}
        if limit is not None:
            report["max_dgram_qlen"] = limit.value
            report["detail"] += f"; {limit.detail()}"
        return report

    def on_poll(self, poll: Poll) -> None:
        now = poll.time
        findings: list[Finding] = [t.finding for t in poll.transitions]
        self._note(findings, now)
        self.orders.fast_path(findings)
        self.terminator.on_findings(poll.findings, now)
        self.terminator.tick()
        self.orders.tick(now)
        if self._idle and len(self.table):
            self._kick.set()
        for gone in self.table.evict(now):
            log.info("forgot rank %d of job %s (silent %.0fs)", gone.rank, gone.job,
                     now - gone.last_msg)

    # -- arrival-time detection (ingest thread) -----------------------------------------
    def _on_step(self, view: RankView, rec: StepRecord) -> None:
        now = self.clock()
        found = []
        if view.nonfinite_loss_step == rec.step or view.nonfinite_grad_step == rec.step:
            found.append(judge_nan(view, self.config.node, now))
        if view.spike_step == rec.step:
            found.append(judge_spike(view, self.config.node, now, self.table.spike_factor))
        if not found:
            if view.steps_total == 1:
                self._kick.set()  # a new rank: the hang watcher learns its deadline
            return
        for f in found:
            log.warning("%s %s at step %d: %s", f.check, f.subject.key(), rec.step, f.reason)
        self._note(found, now)
        if self.agent is not None:
            self.agent.submit_findings(found)
        self.orders.fast_path(found)

    def _on_preempt(self, view: RankView) -> None:
        """A rank got a preemption notice: order its job's save, unless the notice is our
        own SIGTERM to a hung job (it cannot save)."""
        if not self.terminator.ending(view.job):
            self.orders.preempt_job(view)

    def _note(self, findings: list[Finding], now: float) -> None:
        for f in findings:
            s = f.subject
            if s.kind != "rank" or s.rank is None or f.health == Health.HEALTHY:
                continue
            step = f.evidence.get("bad_step", f.evidence.get("step"))
            self.table.note_finding(s.job, s.rank, f.check,
                                    step if isinstance(step, int) else None, now)

    # -- hang watcher --------------------------------------------------------------------
    def _next_deadline(self, now: float) -> float | None:
        """Earliest time a live, progressing rank would pass its hang timeout."""
        best = None
        for _job, views in by_job(self.table.views()).items():
            timeout, _p99 = hang_timeout(self.table, views)
            for v in views:
                since, limit = hang_deadline(self.table, views, v, timeout, now)
                due = since + limit
                if due > now and (best is None or due < best):
                    best = due
        return best

    def _watch_hangs(self) -> None:
        reported: set[tuple[str, int]] = set()
        while not self._stop.is_set():
            try:
                now = self.clock()
                due = self._next_deadline(now)
                if due is not None:
                    self._kick.wait(min(1.0, max(0.002, due - now + 0.001)))
                elif len(self.table):
                    self._kick.wait(1.0)  # hung or idle ranks: look again for recovery
                else:
                    # No rank at all: sleep until one speaks (a first step kicks, and the
                    # poll loop kicks once a rank appears by any message).
                    self._idle = True
                    self._kick.wait()
                    self._idle = False
                self._kick.clear()
                if self._stop.is_set() or self.agent is None:
                    break
                now = self.clock()
                findings = self._hang.run(self.agent.state, now)
                hung = {(f.subject.job, f.subject.rank or 0) for f in findings
                        if f.health == Health.UNHEALTHY}
                if hung - reported or reported - hung:
                    self._note([f for f in findings if f.health == Health.UNHEALTHY], now)
                    self.agent.submit_findings(findings, check=self._hang.name)
                    for f in findings:
                        key = (f.subject.job, f.subject.rank or 0)
                        if f.health == Health.UNHEALTHY and key not in reported:
                            log.warning("rank_hang %s: %s", f.subject.key(), f.reason)
                reported = hung
            except Exception:  # the watcher must outlive any bad state
                log.exception("hang watcher iteration failed")
                self._stop.wait(1.0)
