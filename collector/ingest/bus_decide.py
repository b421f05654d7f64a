"""The leader's view of every batch on the bus: the ``decide`` durable consumers.

Each batch on the batch stream is stored by ONE replica (the shared ``collectors``
consumer, :mod:`.bus`): storage, series and findings need it once. The decisions need
every batch: the predictor's per-GPU windows, checkpoint reports (order progress, the
measured cost of a save), rank summaries (goodput, stragglers), "this agent is alive".
So the replica that holds the leader lock (:mod:`..storage.leader`) also pulls a second
durable consumer of each lane of the stream (:data:`LANES`: telemetry,
:data:`~forewarn.bus.DECIDE_CONSUMER`, and urgent,
:data:`~forewarn.bus.DECIDE_URGENT_CONSUMER`, one :class:`DecideFeed` and task each), and
hands every batch to the policy's ``on_batches``, the urgent lane's ahead of the
telemetry queued on the policy thread. Followers never pull them. JetStream keeps its
acknowledgement floor: a new leader binds the same consumer and goes on where the old one
acknowledged; what the old one held unacknowledged comes back after ``bus_ack_wait_s``
(a leader that steps down negatively acknowledges what it holds, so that comes back at
once). Findings do not take this way: the leader reads every stored finding from the
store (:class:`~..storage.leader.FindingsFeed`), whichever replica or route stored it.

A batch reaches the policy only once the ingest side has stored it: it is looked up in
``batches`` by ``(agent_id, seq)`` (one query per fetched group), so a batch ingest
refused whole (another node's job or agent id, a batch the store could not hold) never
reaches the decisions, and the job map its records are checked against is at least as
new as the one ingest used. When ingest left records out (the stored counts differ), the
batch is authorised again against the map (:func:`~.authz.authorise_batch`) and the policy
gets what remains. A batch not stored within :attr:`DecideFeed.give_up_s` (ingest refused
it) is acknowledged and counted ``not_stored``. A batch handed over already (a
redelivery) is not handed over again, nor twice in one group (a redelivery fetched while
the first delivery was held).

Held batches are looked up again every :data:`RECHECK_S`; the urgent lane's also as soon
as this process's ingest writer committed an urgent batch (:meth:`DecideFeed.stored`,
called after the commit): the batch this replica stored itself goes to the policy without
waiting for the next lookup. One stored by another replica is found by the lookup
(PostgreSQL's LISTEN/NOTIFY could tell that too; not done: the lookup bounds it at 50 ms).

Metric: ``forewarn_collector_decide_batches_total{result}`` (both lanes): ``fed``,
``refused`` (the batch checks failed: ingest refuses it too), ``not_stored``,
``duplicate``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter, Histogram

from forewarn import bus
from forewarn.wire import AgentBatch

from ..config import CollectorConfig
from ..storage.leader import FIRST_WINDOW_S, Leadership, leads_in
from ..storage.state import StateStore
from .authz import NotYourJob, authorise_batch
from .batch import POLICY_PART
from .validate import IngestError, TimeWindow, check_batch

__all__ = ["LANES", "DecideFeed", "Lane", "decide_feeds"]

log = logging.getLogger(__name__)

IDLE_S = 0.1
"""How often a follower looks whether it leads now."""
RECHECK_S = 0.05
"""How soon batches waiting for their ingest are looked up again (the urgent lane: at
once when this process stored one, :meth:`DecideFeed.stored`)."""
FETCH_HELD_S = 0.01
"""How long the urgent lane's fetch waits for more batches while it holds some (it waited
for a batch stored, or :data:`RECHECK_S`, before)."""
KEYS_PER_QUERY = 100
REMEMBERED = 100_000
"""Batches handed over lately, remembered so that a redelivery is not handed over again."""

Deliver = Callable[[list[AgentBatch], bool], Awaitable[None]]
"""``deliver(batches, urgent)``: hand batches of a lane to the policy."""
_Counts = tuple[int, int, int]  # ranks, checkpoints, findings as stored


@dataclasses.dataclass(frozen=True)
class Lane:
    """One lane of the batch stream as the leader pulls it."""

    name: str
    """Its durable consumer."""
    prefix: str
    """Its subjects' prefix (``<prefix>.<node>``)."""
    urgent: bool
    """Its batches go to the policy ahead of queued telemetry."""


LANES = (Lane(bus.DECIDE_CONSUMER, bus.BATCH_PREFIX, urgent=False),
         Lane(bus.DECIDE_URGENT_CONSUMER, bus.URGENT_PREFIX, urgent=True))


def decide_feeds(config: CollectorConfig, store: StateStore, leader: Leadership,
                 deliver: Deliver, registry: Any, *, clock: Callable[[], float] = time.time,
                 stages: Histogram | None = None) -> list[DecideFeed]:
    """One :class:`DecideFeed` per lane of :data:`LANES`, counting into one metric;
    ``stages``: ``urgent_seconds`` (:mod:`..metrics`), whose ``feed`` the urgent lane
    observes."""
    count = Counter("forewarn_collector_decide_batches",
                    "Batches of the leader's decide consumers by result: fed, refused,"
                    " not_stored, duplicate.", ["result"], registry=registry)
    return [DecideFeed(config, store, leader, deliver, count, lane, clock=clock,
                       stages=stages if lane.urgent else None)
            for lane in LANES]


@dataclasses.dataclass
class _Held:
    """A fetched batch waiting for its ingest."""

    msg: Msg
    batch: AgentBatch
    give_up: float
    touched: float
    fetched: float = dataclasses.field(default_factory=time.perf_counter)


class DecideFeed:
    """One lane's consumer (see the module docstring). ``deliver(batches, urgent)`` runs
    the policy's ``on_batches`` (on the policy thread) and returns once it has; only then
    are they acknowledged."""

    def __init__(self, config: CollectorConfig, store: StateStore, leader: Leadership,
                 deliver: Deliver, count: Counter, lane: Lane, *,
                 clock: Callable[[], float] = time.time,
                 stages: Histogram | None = None) -> None:
        self.config = config
        self.store = store
        self.leader = leader
        self.deliver = deliver
        self.lane = lane
        self.clock = clock
        self.give_up_s = 3 * config.bus_ack_wait_s
        """How long a batch may wait for its ingest (a dead replica's batches come back to
        another after ``bus_ack_wait_s``)."""
        self._sub: JetStreamContext.PullSubscription | None = None
        self._held: list[_Held] = []
        self._term = 0
        """The leader's term this replica pulls in (:func:`~..storage.leader.leads_in`)."""
        self._fed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._count = count
        self._stages = stages
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    async def step(self, js: JetStreamContext) -> None:
        """One turn (the bus consumer runs it in a loop that logs and retries NATS or
        store trouble): while this replica leads, pull the decide consumer and feed the
        policy; otherwise let go of it and wait."""
        if self._wake is None:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        if self._sub is not None and not leads_in(self.leader, self._term):
            sub, self._sub = self._sub, None
            await self._let_go(sub)
        if not self.leader.is_leader:
            await asyncio.sleep(IDLE_S)
            return
        if self._sub is None:
            self._term = self.leader.term
            self._sub = await self._bind(js)
        await self._take(self._sub)

    def stored(self) -> None:
        """Any thread (the ingest writer, after its commit): a batch of this lane was
        stored by this process, so the held batches are looked up now."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
                loop.call_soon_threadsafe(wake.set)

    def status(self) -> dict[str, Any]:
        """For ``/readyz``: whether this replica pulls it, batches waiting for their
        ingest."""
        return {"pulling": self._sub is not None, "waiting": len(self._held)}

    async def _bind(self, js: JetStreamContext) -> JetStreamContext.PullSubscription:
        """Create the consumer unless it exists (the first time: from the batches of the
        last :data:`~..storage.leader.FIRST_WINDOW_S`, not the whole stream), then bind."""
        name, stream = self.lane.name, bus.BATCH_STREAM
        try:
            await js.consumer_info(stream, name)
        except nats.js.errors.NotFoundError:
            start = datetime.datetime.fromtimestamp(self.clock() - FIRST_WINDOW_S,
                                                    datetime.UTC)
            config = ConsumerConfig(
                durable_name=name, ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start,
                ack_wait=self.config.bus_ack_wait_s, max_deliver=-1,
                filter_subject=f"{self.lane.prefix}.*",
                max_ack_pending=max(1000, 8 * self.config.bus_fetch_max),
                num_replicas=self.config.bus_stream_replicas)
            await js.add_consumer(stream, config=config)
        log.warning("bus decide: this replica leads; pulling consumer %s", name)
        return await js.pull_subscribe_bind(durable=name, stream=stream)

    async def _let_go(self, sub: JetStreamContext.PullSubscription) -> None:
        """No longer the leader: what is held comes back to the next one at once."""
        held, self._held = self._held, []
        for h in held:
            await h.msg.nak()
        await sub.unsubscribe()
        log.warning("bus decide: no longer the leader; %d batch(es) of %s handed back",
                    len(held), self.lane.name)

    async def _fetch(self, sub: JetStreamContext.PullSubscription) -> float:
        """Pull what is there: the batches ingest would store join those held, the others
        are counted ``refused`` and acknowledged. Returns when (``time.monotonic``)."""
        timeout = RECHECK_S if self._held else 1.0
        if self._held and self.lane.urgent and self._wake is not None:
            # Wait for a batch stored (told by the writer) or the next lookup, then take
            # what came meanwhile: a fetch cannot be cut short without losing its batches.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RECHECK_S)
            self._wake.clear()
            timeout = FETCH_HELD_S
        try:
            msgs = await sub.fetch(self.config.bus_fetch_max, timeout=timeout)
        except TimeoutError:  # nats.errors.TimeoutError, or asyncio's under load
            msgs = []
        now = time.monotonic()
        for msg in msgs:
            await asyncio.sleep(0)  # the urgent lane's turn between batches (as in .bus)
            batch = self._check(msg)
            if batch is None:
                self._count.labels("refused").inc()
                await msg.ack()
            else:
                self._held.append(_Held(msg, batch, now + self.give_up_s, now))
        return now

    async def _take(self, sub: JetStreamContext.PullSubscription) -> None:
        now = await self._fetch(sub)
        if not self._held:
            return
        stored = await asyncio.to_thread(self._stored, [h.batch for h in self._held])
        ready: list[_Held] = []
        batches: list[AgentBatch] = []
        fetched: dict[tuple[str, int], float] = {}
        waiting: list[_Held] = []
        for h in self._held:
            key = (h.batch.agent_id, h.batch.seq)
            if key in stored:
                ready.append(h)
                if key in self._fed or key in fetched:  # handed over, or twice in the group
                    self._count.labels("duplicate").inc()
                    continue
                kept = await self._as_stored(h.batch, stored[key])
                if kept is not None:
                    batches.append(kept)
                    fetched[key] = h.fetched
            elif now > h.give_up:
                self._count.labels("not_stored").inc()
                ready.append(h)
            else:
                waiting.append(h)
        self._held = waiting
        await self._keep_waiting(now)
        # In parts: the policy thread runs urgent work before the next part, but not
        # before the end of the part it is running (a fetched group is up to 256 batches).
        for i in range(0, len(batches), POLICY_PART):
            part = batches[i:i + POLICY_PART]
            self._observe_feed(part, fetched)
            await self.deliver(part, self.lane.urgent)
            if not leads_in(self.leader, self._term):
                # The lease was lost before the policy took this part (it skips it then),
                # or while it did: the group comes back to the next leader at once.
                for h in ready:
                    await h.msg.nak()
                return
            self._count.labels("fed").inc(len(part))
            self._remember(part)
        for h in ready:
            await h.msg.ack()

    def _observe_feed(self, part: list[AgentBatch], fetched: dict[tuple[str, int], float]
                      ) -> None:
        """``urgent_seconds{stage="feed"}``: fetched → handed to the policy thread."""
        if self._stages is not None:
            for b in part:
                self._stages.labels("feed").observe(
                    time.perf_counter() - fetched[(b.agent_id, b.seq)])

    def _check(self, msg: Msg) -> AgentBatch | None:
        """The batch as ingest checks it (``None`` when ingest refuses it whole)."""
        c = self.config
        try:
            node = bus.node_of(msg.subject.rpartition(".")[2])
            if len(msg.data) > c.max_body_bytes:
                return None
            window = TimeWindow(self.clock(), c.ingest_max_age_s, c.ingest_max_future_s)
            return check_batch(msg.data, node=node, max_items=c.max_batch_items,
                               window=window).batch
        except (ValueError, IngestError):
            return None

    def _stored(self, batches: Sequence[AgentBatch]) -> dict[tuple[str, int], _Counts]:
        """Which of ``batches`` ingest stored (as their own node's), with what it kept."""
        out: dict[tuple[str, int], _Counts] = {}
        for i in range(0, len(batches), KEYS_PER_QUERY):
            part = batches[i:i + KEYS_PER_QUERY]
            where = " OR ".join(["(agent_id = ? AND seq = ? AND node = ?)"] * len(part))
            params = [v for b in part for v in (b.agent_id, b.seq, b.node)]
            for row in self.store.query("SELECT agent_id, seq, ranks, checkpoints, findings"
                                        f" FROM batches WHERE {where}", params):
                out[(str(row["agent_id"]), int(row["seq"]))] = (
                    int(row["ranks"]), int(row["checkpoints"]), int(row["findings"]))
        return out

    async def _as_stored(self, batch: AgentBatch, counts: _Counts) -> AgentBatch | None:
        """``batch`` as ingest applied it: without the records it left out."""
        if counts == (len(batch.ranks), len(batch.checkpoints), len(batch.findings)):
            return batch
        return await asyncio.to_thread(self._authorised, batch)

    def _authorised(self, batch: AgentBatch) -> AgentBatch | None:
        try:
            with self.store.write() as conn:  # reads the job map only
                kept, _ignored = authorise_batch(conn, batch, self.clock())
        except NotYourJob:
            return None
        return kept

    async def _keep_waiting(self, now: float) -> None:
        """Batches waiting for their ingest longer than half the ack wait are marked in
        progress, so JetStream does not deliver them again meanwhile."""
        for h in self._held:
            if now - h.touched > self.config.bus_ack_wait_s / 2:
                await h.msg.in_progress()
                h.touched = now

    def _remember(self, batches: Sequence[AgentBatch]) -> None:
        for b in batches:
            self._fed[(b.agent_id, b.seq)] = None
        while len(self._fed) > REMEMBERED:
            self._fed.popitem(last=False)
