"""The running service as routes and the policy see it: :class:`CollectorContext`
(``request.app.state.ctx``; the policy sees it through
:class:`~forewarn.collector.decide.seam.DecideContext`), and how stored batches, findings and
acknowledgements reach the policy thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from forewarn.bus import BUS_ADDRESS
from forewarn.wire import AgentBatch, CommandAck, Finding

from ..config import CollectorConfig
from ..decide.policy_thread import PolicyThread
from ..decide.seam import AckHook, BatchHook, FeedHook, FindingsPolicy
from ..ingest.batch import POLICY_PART, IngestWriter
from ..jobs.jobmap import StoreJobView
from ..metrics import CollectorMetrics
from ..storage.commands import CommandQueue, NodeCommand
from ..storage.fence import NotLeaderError
from ..storage.leader import FindingsFeed, Leadership, SoleLeader, leads_in
from ..storage.remote_write import RemoteWriter
from ..storage.state import StateStore
from ..storage.telemetry import TelemetryWriter
from .auth import TokenRegistry

if TYPE_CHECKING:
    import httpx

    from ..ingest.bus import BusConsumer

__all__ = ["FEED_INTERVAL_S", "POLICY_BACKLOG_MAX", "CollectorContext"]

log = logging.getLogger(__name__)

T = TypeVar("T")

FEED_INTERVAL_S = 0.2
"""How often the leader reads new findings from shared state (adds at most this to the
latency of a decision in the scale-out mode)."""

POLICY_BACKLOG_MAX = 20_000
"""Batches waiting for the policy thread beyond which sample-only batches skip it."""


@dataclasses.dataclass
class CollectorContext:
    """Everything a route or the policy needs; ``request.app.state.ctx``."""

    config: CollectorConfig
    store: StateStore
    metrics: CollectorMetrics
    commands: CommandQueue
    jobs: StoreJobView
    telemetry: TelemetryWriter
    writer: IngestWriter
    tokens: TokenRegistry
    outbound: httpx.AsyncClient | None
    policy: FindingsPolicy | None
    clock: Callable[[], float]
    loop: asyncio.AbstractEventLoop | None = None
    series: RemoteWriter | None = None
    """Remote write of the GPU series, when ``remote_write_url`` is set."""
    leader: Leadership = dataclasses.field(default_factory=SoleLeader)
    """Whether this replica decides (always, with embedded state; see
    :mod:`~forewarn.collector.storage.leader`)."""
    bus: BusConsumer | None = None
    """The NATS bus side of this replica (``bus_url`` set), once started."""
    bus_decides: bool = False
    """The leader hears bus batches from the bus's decide consumer (:mod:`.leading`)."""
    urgent_stored: Callable[[], None] | None = None
    """Tells the leader's urgent decide lane that this process stored an urgent batch
    (:meth:`~..ingest.bus_decide.DecideFeed.stored`; set by :mod:`.leading`)."""
    _policy_pool: PolicyThread = dataclasses.field(default_factory=PolicyThread)
    _flush_wanted: asyncio.Event | None = None
    flush_error: str = ""
    """Why the last telemetry flush failed ("" when it worked), for /readyz."""
    flush_time: float = 0.0
    """When the last telemetry flush ended (Unix time; 0 before the first)."""
    _staged: int = 0
    _policy_backlog: int = 0
    _backlog_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    async def run_policy(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        """Run ``fn(*args)`` on the policy thread (serialised with every hook call);
        ``urgent``: ahead of the batches queued there (findings, urgent batches)."""
        pool = self._policy_pool
        return await asyncio.wrap_future(
            pool.submit_urgent(fn, *args) if urgent else pool.submit(fn, *args))

    def submit_bulk(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` on the policy thread's bulk lane: it runs only while no
        decision work (agent batches, acks, timers) waits (alert storms)."""
        return self._policy_pool.submit_bulk(fn, *args)

    def submit_next(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` first on the policy thread's decision lane, behind urgent
        work only: the next part of the item in progress (a scoring in parts)."""
        return self._policy_pool.submit_next(fn, *args)

    def accept_ack(self, ack: CommandAck, node: str) -> str:
        """Record ``node``'s answer to a command (HTTP or the bus) and tell the policy;
        returns :meth:`CommandQueue.ack`'s ``acked``, ``already`` or ``unknown``."""
        state = self.commands.ack(ack, node)
        if state != "unknown" and self.policy is not None:
            self._policy_pool.submit(self._policy_ack, ack, node)
        return state

    # -- runs on the policy thread ----------------------------------------------------

    def _policy_findings(self, findings: list[Finding]) -> None:
        if self.leader.shared:
            return  # with shared state the leader reads every finding from the feed
        self._decide(findings)

    def _decide(self, findings: list[Finding]) -> None:
        """Run findings through the policy and queue the commands it returns (in one
        transaction). A refused write (this replica no longer leads) is left to the fence,
        which counted and said it; any other error is a counted policy error: nobody
        waits for this call (:meth:`_policy_batches`), so nothing else would say it."""
        if self.policy is None or not findings or not self.leader.is_leader:
            return
        try:
            out = self.policy.on_findings(findings, self.store, self.clock())
        except Exception:
            self.metrics.policy_errors.inc()
            log.exception("policy.on_findings failed on %d findings", len(findings))
            return
        queued = [item for item in out or () if isinstance(item, NodeCommand)]
        try:
            self.commands.enqueue_many(queued)
        except NotLeaderError:
            return  # the next leader decides these findings again (its feed's cursor)
        except Exception:
            self.metrics.policy_errors.inc()
            log.exception("queuing the policy's %d command(s) failed", len(queued))

    def _decide_fed(self, found: list[tuple[str, Finding]], term: int) -> None:
        """The leader's feed: findings with their origins to a policy that tells them
        apart (:class:`~..decide.seam.FeedHook`), the findings alone to any other; only
        while this replica still leads in the ``term`` the feed took them in."""
        if not leads_in(self.leader, term):
            return
        policy = self.policy
        if not isinstance(policy, FeedHook):
            self._decide([f for _origin, f in found])
            return
        try:
            policy.on_feed(found, self.clock())
        except Exception:
            self.metrics.policy_errors.inc()
            log.exception("policy.on_feed failed on %d findings", len(found))

    def _feed_settled(self) -> bool:
        """Whether the policy decided everything the feed handed it (:class:`FeedHook`)."""
        policy = self.policy
        return not isinstance(policy, FeedHook) or policy.settled()

    def _policy_batches(self, batches: list[AgentBatch], backlog: bool = True,
                        since: float | None = None) -> None:
        """``since``: urgent batches, when (``perf_counter``) they were stored (or handed
        over by the leader's feed): their ``policy_wait``, ``observe`` and ``decide`` are
        measured."""
        started = time.perf_counter()
        if backlog:
            with self._backlog_lock:
                self._policy_backlog -= len(batches)
                self.metrics.policy_backlog.set(self._policy_backlog)
        policy = self.policy
        if isinstance(policy, BatchHook) and self.leader.is_leader:
            try:
                policy.on_batches(batches, self.clock())
            except Exception:
                self.metrics.policy_errors.inc()
                log.exception("policy.on_batches failed")
        observed = time.perf_counter()
        self._policy_findings([f for b in batches for f in b.findings])
        if since is not None:
            stage = self.metrics.urgent_seconds
            stage.labels("policy_wait").observe(started - since)
            stage.labels("observe").observe(observed - started)
            stage.labels("decide").observe(time.perf_counter() - observed)

    def _policy_ack(self, ack: CommandAck, node: str) -> None:
        policy = self.policy
        if isinstance(policy, AckHook) and self.leader.is_leader:
            try:
                policy.on_ack(ack, node)
            except Exception:
                self.metrics.policy_errors.inc()
                log.exception("policy.on_ack failed")

    def on_stored(self, batches: list[AgentBatch], addresses: list[str]) -> None:
        """Writer thread: hand stored batches to the policy thread (not those of the bus
        when the leader hears them from its decide consumer); maybe wake the flush."""
        if self.urgent_stored is not None and any(b.urgent for b in batches):
            self.urgent_stored()  # committed: the urgent decide lane looks it up now
        if self.policy is not None:
            batches_for_policy = batches if not self.bus_decides else [
                b for b, a in zip(batches, addresses, strict=True) if a != BUS_ADDRESS]
            if self._policy_backlog > POLICY_BACKLOG_MAX:
                # The policy thread is behind: keep what it must see (findings, ranks,
                # checkpoint reports), skip batches that carry only samples (counted).
                kept = [b for b in batches_for_policy
                        if b.findings or b.ranks or b.checkpoints or b.xids]
                self.metrics.policy_skipped.inc(len(batches_for_policy) - len(kept))
                batches_for_policy = kept
            if batches_for_policy:
                with self._backlog_lock:
                    self._policy_backlog += len(batches_for_policy)
                # Urgent batches (findings, checkpoint reports) overtake the telemetry
                # queued before them; each kind stays in order.
                urgent = [b for b in batches_for_policy if b.urgent]
                rest = [b for b in batches_for_policy if not b.urgent]
                if urgent:
                    self._policy_pool.submit_urgent(self._policy_batches, urgent, True,
                                                    time.perf_counter())
                # In parts: urgent work runs between them, not after a whole group.
                for i in range(0, len(rest), POLICY_PART):
                    self._policy_pool.submit(self._policy_batches, rest[i:i + POLICY_PART])
        loop, event = self.loop, self._flush_wanted
        if loop is not None and event is not None and not loop.is_closed():
            self._staged += sum(len(b.samples) for b in batches)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._maybe_flush)

    def _maybe_flush(self) -> None:
        if self._flush_wanted is not None and self._staged >= self.config.flush_samples:
            self._flush_wanted.set()

    # -- the service's loops and start/stop steps (lifespan, :mod:`.lifespan`) -----------

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The app's event loop, once it runs."""
        self.loop = loop
        self._flush_wanted = asyncio.Event()
        self.commands.bind_loop(loop)

    def stop_policy_thread(self) -> None:
        """Wait for the hook calls queued on the policy thread, then end it."""
        self._policy_pool.shutdown(wait=True)

    async def leader_feed(self, feed: FindingsFeed) -> None:
        """Shared state: while this replica leads, every finding any replica stored goes
        through the policy (once; the cursor is saved after each group)."""
        leading, term = False, 0
        held: int | None = None  # the saved cursor stays at or before this
        while True:
            await asyncio.sleep(FEED_INTERVAL_S)
            try:
                if not leading or not leads_in(self.leader, term):
                    leading, term, held = False, self.leader.term, None
                    if not self.leader.is_leader:
                        continue
                    await asyncio.to_thread(feed.resume)
                    leading = True
                before = feed.mark()
                found = await asyncio.to_thread(feed.take)
                if found:  # decisions: ahead of the bus batches queued there
                    await self.run_policy(self._decide_fed, found, term, urgent=True)
                # Findings handed over but not decided yet (alerts wait on the bulk lane)
                # keep the saved cursor before them until they are.
                if self._feed_settled():
                    held = None
                elif held is None:
                    held = before
                if not leads_in(self.leader, term):
                    # The lease was lost before these were decided (or while they were):
                    # the cursor stays where it was, so the next leader decides them. One
                    # decided here already gets the same order id there (one order).
                    leading = False
                    continue
                await asyncio.to_thread(feed.save, held)
            except NotLeaderError:
                leading = False  # another replica leads: the fence counted and said it
            except Exception:
                leading = False  # resume from the saved cursor once the store answers
                log.exception("leader feed failed; retried in %.1f s", FEED_INTERVAL_S)

    async def periodic_flush(self) -> None:
        """Write staged telemetry to Parquet every ``flush_interval_s``, or sooner when
        ``flush_samples`` are staged (leader only)."""
        assert self._flush_wanted is not None, "bind_loop first"
        event = self._flush_wanted
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), self.config.flush_interval_s)
            event.clear()
            if not self.leader.is_leader:
                continue  # shared state: the leader alone writes the Parquet export
            try:
                self._staged = 0
                try:
                    await asyncio.to_thread(self.telemetry.flush, max_rows=10**9)
                except Exception as exc:
                    self.flush_error = f"{type(exc).__name__}: {exc}"[:1000]
                    raise
                finally:
                    self.flush_time = self.clock()
                self.flush_error = ""
            except Exception:
                log.exception("telemetry flush failed; staged samples are kept and retried")
