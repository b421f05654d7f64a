"""Job-wide checkpoint orders: one step S for every rank of a multi-node job.

The collector chooses S ahead of the fastest rank (docs/design.md, "Contracts at the boundaries"):

    S = estimated current step of the furthest rank + margin
    margin = ceil((delivery latency + safety) / p50 step time of the fastest rank) + 1

clamped to ``[min_margin_steps, max_margin_steps]`` (the one rule both agent and collector
use: :mod:`forewarn.ordering`). The furthest rank's step is its last
reported step advanced by its own p50 pace since the report (agents report every few
seconds, so the raw number is stale). Delivery over the long poll is near zero; ``safety``
covers agent -> hook hand-off and clock skew. No collective and no device sync is added
to the step: every rank saves when it reaches S.

The order goes to every node of the job as ``Command(kind="checkpoint")``. The book tracks
acknowledgements per node and :class:`CheckpointReport`\\ s per rank: an order is ``done``
when every rank reported ``done``; if any rank reports ``missed`` (S had passed when the
order arrived), the order is reissued once with a new S computed from the missed report's
step, up to ``max_reissues`` times; ``failed`` when a rank failed or reissues ran out.

A save hold (:class:`~forewarn.wire.SaveHold`) follows the same rule: its step is chosen as
S is, and a rank that had already passed it reports ``missed`` under the hold's request id
with the last step it passed unheld; the hold then goes out again to every node of the job
for the step after that one, naming the hold it ``replaces``
(:func:`forewarn.ordering.replacement_hold` says why not further ahead;
:meth:`OrderBook.on_hold_report`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter

from forewarn.ordering import IssuedHolds, order_step, replacement_hold
from forewarn.wire import CheckpointOrder, CheckpointReport, CommandAck, Finding, SaveHold

from ..jobs.jobview import JobInfo

__all__ = ["CommandSink", "HoldNote", "JobOrder", "OrderBook", "OrderNote", "OrderSettings",
           "choose_step", "order_key"]


class CommandSink(Protocol):
    """Where orders go: the service's per-node command queues.

    Contract: ``order_checkpoint`` queues one ``Command(kind="checkpoint", order=order)``
    per node (id ``<request_id>@<node>``), is idempotent per id, and returns what it queued;
    ``hold_saves`` the same with ``Command(kind="hold", hold=hold)``. Each stores its
    ``action`` row (the store's ``record_action`` keywords) in the same transaction as the
    commands.
    """

    def order_checkpoint(self, nodes: Iterable[str], order: CheckpointOrder,
                         action: dict[str, Any] | None = None) -> Sequence[Any]:
        ...

    def hold_saves(self, nodes: Iterable[str], hold: SaveHold,
                   action: dict[str, Any] | None = None) -> Sequence[Any]:
        ...


OrderNote = Callable[["JobOrder"], dict[str, Any]]
"""The ``actions`` row of an order (the store's ``record_action`` keywords), written with
its commands."""
HoldNote = Callable[[SaveHold], dict[str, Any]]
"""The ``actions`` row of a save hold, written with its commands."""


@dataclasses.dataclass(frozen=True)
class OrderSettings:
    """How far ahead S is placed and how misses are handled (``order_*`` config keys)."""

    delivery_latency_s: float = 0.5
    """Expected collector -> agent -> hook delivery time (long poll: near zero)."""
    safety_s: float = 2.0
    """Extra lead for hand-off, clock skew and stale reports."""
    min_margin_steps: int = 2
    max_margin_steps: int = 1000
    unknown_step_s: float = 1.0
    """Step time assumed when no rank reported one."""
    max_reissues: int = 3
    keep: int = 1000
    """Orders remembered (oldest forgotten first)."""


def choose_step(
    job: JobInfo, now: float, settings: OrderSettings, floor: int | None = None
) -> tuple[int, dict[str, Any]]:
    """S for ``job`` and the inputs it came from. ``floor``: a step S must exceed
    (the step a rank reported when it missed the previous order)."""
    current = job.estimated_step(now)
    p50 = job.step_seconds_p50 or settings.unknown_step_s
    step, margin = order_step(current, p50, lead_s=settings.delivery_latency_s + settings.safety_s,
                              floor=floor, min_margin=settings.min_margin_steps,
                              max_margin=settings.max_margin_steps)
    return step, {
        "estimated_step": current,
        "floor": floor,
        "step_seconds_p50": p50,
        "p50_source": "ranks" if job.step_seconds_p50 else "default",
        "delivery_latency_s": settings.delivery_latency_s,
        "safety_s": settings.safety_s,
        "margin_steps": margin,
        "step": step,
    }


@dataclasses.dataclass
class JobOrder:
    """One checkpoint order for one job, and what came back for it."""

    request_id: str
    job: str
    step: int
    reason: str
    issued: float
    nodes: tuple[str, ...]
    world_size: int
    inputs: dict[str, Any]
    attempt: int = 0
    decision_id: str = ""
    acks: dict[str, bool] = dataclasses.field(default_factory=dict)
    """node -> ok, from :class:`CommandAck`."""
    ranks: dict[int, str] = dataclasses.field(default_factory=dict)
    """rank -> last phase reported (started, done, failed, missed)."""
    rank_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    """rank -> the step it reported (the saved step, or its current step when missed)."""
    status: str = "issued"
    """issued, done, reissued (superseded by an order whose reason names this one), failed."""


def _new_request_id() -> str:
    return "ord-" + uuid.uuid4().hex[:16]


def order_key(finding: Finding, job: str) -> str:
    """What an order for ``job`` about ``finding`` is, whoever decides it: the finding's
    whole content and the job. A new leader that decides a finding the old one decided
    too (it cannot know how far the old one got) gets the same key, hence the same
    request id and command ids: the command queue keeps one, JetStream drops the copy
    (``Nats-Msg-Id``), an agent applies a command id once and the hook a request id once."""
    return f"{job}|{msgspec.json.encode(finding).decode()}"


def _keyed_request_id(key: str) -> str:
    return "ord-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class OrderBook:
    """Issues job-wide orders and follows them to done (see the module docstring).

    Not thread-safe: call from the collector's event loop.
    """

    def __init__(
        self,
        sink: CommandSink,
        settings: OrderSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
        new_id: Callable[[], str] = _new_request_id,
    ) -> None:
        self.sink = sink
        self.settings = settings or OrderSettings()
        self._clock = clock
        self._new_id = new_id
        self._orders: dict[str, JobOrder] = {}
        self._jobs: dict[str, JobInfo] = {}
        self._holds: IssuedHolds[JobInfo] = IssuedHolds(keep=self.settings.keep)
        """Holds issued, each with the job it was issued for."""
        self._unanswered: list[CheckpointReport] = []
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._m_orders = Counter(
            "forewarn_collector_checkpoint_orders",
            "Job-wide checkpoint orders by event (issued, reissued, done, failed; hold: "
            "a job told to stop saving).",
            ["event"],
            registry=registry,
        )

    def issue(
        self, job: JobInfo, reason: str, *, decision_id: str = "", floor: int | None = None,
        attempt: int = 0, key: str = "", note: OrderNote | None = None,
    ) -> JobOrder:
        """Choose S for ``job`` and queue the order for each of its nodes, with the
        ``actions`` row ``note`` makes of it. ``key`` (:func:`order_key`): the request id
        comes from it, so the same order decided again is the same order; without it, a
        new id."""
        now = self._clock()
        step, inputs = choose_step(job, now, self.settings, floor)
        order = CheckpointOrder(
            request_id=self._request_id(key), job=job.job, step=step, reason=reason[:4096],
            issued=now)
        record = JobOrder(
            request_id=order.request_id, job=job.job, step=step, reason=order.reason,
            issued=now, nodes=job.nodes, world_size=job.world_size, inputs=inputs,
            attempt=attempt, decision_id=decision_id,
        )
        self.sink.order_checkpoint(job.nodes, order, None if note is None else note(record))
        self._orders[order.request_id] = record
        self._jobs[order.request_id] = job
        while len(self._orders) > self.settings.keep:
            oldest = next(iter(self._orders))
            self._orders.pop(oldest)
            self._jobs.pop(oldest, None)
        self._m_orders.labels("issued" if attempt == 0 else "reissued").inc()
        return record

    def hold(self, job: JobInfo, onset_step: int, reason: str, *, key: str = "",
             note: HoldNote | None = None) -> SaveHold:
        """Tell every node of ``job`` that its state is suspect since ``onset_step`` and
        that its ranks stop saving at a step chosen as an order's S (ahead of the fastest
        rank, so all of them stop at the same step): :class:`~forewarn.wire.SaveHold`.
        ``key`` and ``note`` as for :meth:`issue`."""
        now = self._clock()
        step, _inputs = choose_step(job, now, self.settings)
        hold = SaveHold(request_id=self._request_id(key), job=job.job, onset_step=onset_step,
                        step=max(step, onset_step), reason=reason[:4096], issued=now)
        self._send_hold(job, hold, 0, note)
        self._m_orders.labels("hold").inc()
        return hold

    def _request_id(self, key: str) -> str:
        return _keyed_request_id(key) if key else self._new_id()

    def _send_hold(self, job: JobInfo, hold: SaveHold, attempt: int,
                   note: HoldNote | None) -> None:
        self.sink.hold_saves(job.nodes, hold, None if note is None else note(hold))
        self._holds.add(hold, attempt, job)

    def on_hold_report(self, report: CheckpointReport, job: JobInfo | None = None,
                       note: HoldNote | None = None) -> SaveHold | None:
        """A rank reported ``missed`` for a hold (it had passed the hold's step): the hold
        again for every node of the job, from the step after the one reported, replacing
        the missed one (with the ``actions`` row ``note`` makes of it). Returns the new
        hold, if any."""
        missed = self._holds.missed(report)
        if missed is None:
            return None
        hold, attempt, issued_for = missed
        if attempt >= self.settings.max_reissues:
            self._m_orders.labels("failed").inc()
            return None
        new = replacement_hold(hold, report.step, self._new_id(), self._clock())
        try:
            self._send_hold(job or issued_for, new, attempt + 1, note)
        except Exception:  # not queued (the store failed): the rank's next miss asks again
            self._holds.add(hold, attempt, issued_for)
            raise
        self._m_orders.labels("reissued").inc()
        return new

    def restore(self, orders: Iterable[tuple[JobOrder, JobInfo]],
                holds: Iterable[tuple[SaveHold, int, JobInfo]],
                misses: Iterable[CheckpointReport] = ()) -> None:
        """Follow these orders (each with its job's snapshot) and holds (with their
        reissues so far) instead of what the book held: a replica that starts to lead, or
        a collector started again, takes them over from the store
        (:mod:`.order_history`). ``misses``: missed reports nobody answered yet
        (:meth:`take_unanswered`)."""
        self._unanswered = list(misses)
        self._orders, self._jobs = {}, {}
        for order, job in orders:
            self._orders[order.request_id] = order
            self._jobs[order.request_id] = job
        self._holds = IssuedHolds(keep=self.settings.keep)
        for hold, attempt, job in holds:
            self._holds.add(hold, attempt, job)

    def take_unanswered(self) -> list[CheckpointReport]:
        """The misses :meth:`restore` was given, once (the caller answers them)."""
        out, self._unanswered = self._unanswered, []
        return out

    def get(self, request_id: str) -> JobOrder | None:
        """The order with this request id."""
        return self._orders.get(request_id)

    def orders(self, job: str | None = None) -> list[JobOrder]:
        """Remembered orders, oldest first (of ``job`` when given)."""
        return [o for o in self._orders.values() if job is None or o.job == job]

    def on_ack(self, ack: CommandAck) -> JobOrder | None:
        """Note a node's acknowledgement of ``<request_id>@<node>``."""
        request_id = ack.id.rsplit("@", 1)[0]
        order = self._orders.get(request_id)
        if order is None:
            return None
        order.acks[ack.node] = ack.ok
        return order

    def on_report(self, report: CheckpointReport, job: JobInfo | None = None,
                  note: OrderNote | None = None) -> JobOrder | None:
        """Take a rank's report; returns the new order when a miss caused a reissue.

        ``job`` is the job's current snapshot for the new S (else the one issued with);
        ``note`` makes the reissue's ``actions`` row.
        """
        order = self._orders.get(report.request_id)
        # A report counts only for its own job's order: a node may report only its own
        # ranks (collector.authz), so another job's report must not complete this one.
        if order is None or order.status not in ("issued",) or report.job != order.job:
            return None
        order.ranks[report.rank] = report.phase
        order.rank_steps[report.rank] = report.step
        if report.phase == "missed":
            return self._reissue(order, report, job, note)
        if report.phase == "failed":
            order.status = "failed"
            self._m_orders.labels("failed").inc()
        elif sum(1 for p in order.ranks.values() if p == "done") >= order.world_size:
            order.status = "done"
            self._m_orders.labels("done").inc()
        return None

    def _reissue(
        self, order: JobOrder, report: CheckpointReport, job: JobInfo | None,
        note: OrderNote | None,
    ) -> JobOrder | None:
        if order.attempt >= self.settings.max_reissues:
            order.status = "failed"
            self._m_orders.labels("failed").inc()
            return None
        snapshot = job or self._jobs.get(order.request_id)
        if snapshot is None:
            return None
        floor = max([report.step, *order.rank_steps.values()])
        new = self.issue(
            snapshot,
            f"reissue of {order.request_id}: rank {report.rank} was at step {report.step} "
            f"past S={order.step}; {order.reason}",
            decision_id=order.decision_id,
            floor=floor,
            attempt=order.attempt + 1,
            key=f"{order.request_id}|reissue",
            note=note,
        )
        order.status = "reissued"
        return new
