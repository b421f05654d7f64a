"""Checkpoint orders to the local ranks and the local fast path.

Choosing the step
-----------------
Every rank of a job must save the same step S, without a collective and without a device
sync. The agent picks S ahead of the fastest rank::

    s_now = max over ranks (last_step + floor((now - t_last_step) / p50))
    S     = s_now + ceil((delivery_latency_s + safety_s) / p50) + 1

(the one rule both agent and collector use: :mod:`forewarn.ordering`;
:mod:`forewarn.agent.order_step`).
``p50`` is the job's median step time on this node, ``t_last_step`` when the agent saw the
rank's last step, ``delivery_latency_s`` covers the datagram and the hook noticing it
(defaults 0.05 s) and ``safety_s`` (0.25 s) the jitter of step times. Each reissue after a
``missed`` report doubles the margin. Without step times yet, the margin is
``fallback_steps`` (10).

A preemption order (below) is placed closer, because the scheduler's grace period is
ticking: by the same rule with no extra lead, S is the first step no rank can have
reported when the order lands (:func:`preempt_step`)::

    s_arrival = max over ranks (last_step + floor((now + delivery - t_last_step) / p10))
    S         = s_arrival + 1

``delivery`` is measured (the slowest of the ranks' recent beats from hook to agent, plus
the interpreter's switch interval for the hook's thread), ``p10`` the job's fast pace. With
50 ms steps that is the next step, or the one after when the ranks are about to finish
theirs. A rank for which S already passed still reports ``missed`` and the whole job gets
a new S, 2, then 4, ... steps ahead (of the estimate, and of the step the rank reported:
every reissue, preemption or not, passes that step to the rule as its ``floor``).

Protocol
--------
The order (:class:`forewarn.wire.CheckpointOrder`) goes to each local rank's ``reply_to``.
Ranks whose step is below S save at S and report ``started``/``done``; a rank for which S
already passed reports ``missed`` with its current step. On ``missed`` (or when the step
records show a rank the order reached went past S without a report for it: the datagram
was lost)
the agent issues a new S for the whole job under a new request id, when the agent chose S.
An order from the collector with an explicit step is not reissued here: the reports go up
and the collector, which chose S for all nodes, reissues.

An order is for every rank of the job this node knows whose process runs, live or marked
gone (a gone rank may only be unheard: :mod:`forewarn.agent.order_ranks`); one that cannot
take it yet gets it on a later poll. The collector's ack names the ranks not live then.
An order is for the processes it was sent to: once one is replaced (the job restarted) the
order *ends*, undelivered copies too. The new round resumed from an earlier checkpoint and
would take it: one rank saving alone waits in the collective save for peers that step on
(the job wedges), a preemption order would stop it. Its own notice orders again.

Local fast path
---------------
A local critical finding orders a checkpoint of the affected jobs on its own, once per
incident (cooldown per subject: the XID and the uncorrectable-ECC finding of one DBE are one
incident; a materially worse finding of the same check orders again,
:mod:`forewarn.escalation`), even with no collector:

* an unhealthy GPU finding whose suggested action is checkpoint, reset, reboot, drain or
  inspect: the jobs with a rank on that GPU (local rank -> GPU index, identity by default);
  an unhealthy node finding with such an action: every job on the node;
* a grad-norm spike: that job (the state is still finite; see checks/grad_spike.py).

Only jobs whose every rank runs on this node are ordered locally: a job that spans nodes
saves collectively (torch.distributed.checkpoint), so ranks saving on one node only would
wait forever for the others. Its finding goes up to the collector (urgent), which orders
every node at one step; ``deferred_total`` counts these.

Not ordered: NaN/Inf loss (a poisoned state is not worth saving and would rotate a good
checkpoint out; the finding says restart from the last good one), a hang (a hung job cannot
save) and a gone rank (its peers will block in the next collective). A NaN/Inf loss instead
*holds* the job's saves (:class:`forewarn.wire.SaveHold`, as the collector's policy does,
so even with the collector down): the state is suspect since the finding's ``bad_step``,
and every local rank stops saving at one step chosen as an order's S. Jobs spanning nodes
are left to the collector here too. A rank that had already passed that step reports
``missed`` (the last step it passed unheld) and the hold goes again to every local rank from
the step after it, ``replaces`` naming the missed one (:class:`forewarn.wire.SaveHold`,
:func:`forewarn.ordering.replacement_hold`).

Preemption
----------
A rank that gets a preemption notice (SIGTERM, Slurm's USR1 warning, a maintenance-notice
file) says so in its next beat, sent at once. The first such beat of a job orders every
local rank to save at S chosen by :func:`preempt_step`, reason ``preempted: ...``
(``preempt_job``);
further notices while that order is open (Slurm's double SIGTERM, the other ranks' own
signals) add nothing. Each rank exits after that save, so all of them save the same step
and none waits in a collective for a peer that left. Jobs spanning nodes are left to the
hook's collective fallback (``agree_every``).

The hang terminator lives in :mod:`forewarn.agent.hang`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from forewarn.agent.delivery import Delivery
from forewarn.agent.holds import LocalHolds
from forewarn.agent.order_ranks import job_ranks
from forewarn.agent.order_step import choose_step, preempt_step
from forewarn.agent.rank_state import RankView
from forewarn.agent.ranks import RankTable
from forewarn.escalation import escalates
from forewarn.wire import (
    PREEMPTED,
    CheckpointOrder,
    CheckpointReport,
    Finding,
    Health,
    IntervalAdvice,
    SaveHold,
    SuggestedAction,
    encode,
)

__all__ = ["CheckpointOrders", "OrderStatus", "choose_step", "preempt_step", "reason_label"]

log = logging.getLogger(__name__)

FAST_PATH_ACTIONS = frozenset({
    SuggestedAction.CHECKPOINT, SuggestedAction.RESET_GPU, SuggestedAction.REBOOT,
    SuggestedAction.DRAIN, SuggestedAction.INSPECT_HARDWARE,
})
"""GPU/node findings with these actions (and unhealthy) order a checkpoint locally."""

RANK_FAST_PATH_CHECKS = frozenset({"grad_spike"})
"""Rank findings that order a checkpoint of their job (nan_loss and rank_hang do not)."""

RANK_HOLD_CHECKS = frozenset({"nan_loss"})
"""Rank findings that hold their job's saves (the state is poisoned)."""


def reason_label(reason: str, origin: str) -> str:
    """A bounded metric label from a free-text reason: its first word (``xid`` from
    ``xid: ...``), letters, digits and ``_`` only, else the origin."""
    head = reason.split(":", 1)[0].split(" ", 1)[0].strip().lower()
    label = "".join(c for c in head if c.isascii() and (c.isalnum() or c == "_"))[:32]
    return label or origin


@dataclasses.dataclass
class OrderStatus:
    """One order and what each local rank said about it."""

    order: CheckpointOrder
    origin: str
    """``local`` (fast path, the agent chose S), ``collector``, or ``manual``."""
    root: str
    """Request id of the first order of this chain (reissues share it)."""
    agent_chose_step: bool
    expected: frozenset[int]
    delivery: Delivery
    """The processes it is for and the ranks it has not reached yet."""
    phases: dict[int, str] = dataclasses.field(default_factory=dict)
    not_live: frozenset[int] = frozenset()
    """Ranks not live when it was issued (it waits for them: :mod:`.order_ranks`)."""
    reissues: int = 0
    closed: str = ""
    """Why the order ended (done, superseded, failed, expired, ended); empty while open."""
    done_seconds: float | None = None


class CheckpointOrders:
    """Issues checkpoint orders to local ranks and tracks their reports.

    ``send(path, data) -> bool`` delivers one datagram (the ingest socket's ``send``);
    ``clock`` is Unix time for the order records, ``monotonic`` for timeouts.
    """

    def __init__(
        self,
        table: RankTable,
        send: Callable[[str, bytes], bool],
        *,
        delivery_latency_s: float = 0.05,
        safety_s: float = 0.25,
        cooldown_s: float = 300.0,
        max_reissues: int = 5,
        ttl_s: float = 900.0,
        gpu_of: Callable[[int], int | None] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.send = send
        self.delivery_latency_s = delivery_latency_s
        self.safety_s = safety_s
        self.cooldown_s = cooldown_s
        self.max_reissues = max_reissues
        self.ttl_s = ttl_s
        self.gpu_of = gpu_of or (lambda local_rank: local_rank)
        self.clock = clock
        self.monotonic = monotonic
        self._lock = threading.RLock()
        self._orders: dict[str, OrderStatus] = {}
        self._trailing: list[tuple[str, Delivery]] = []
        """``(job, delivery)`` of superseded orders not delivered to every rank yet: a rank
        that got the old order saves at its step, so every rank must get it."""
        self.holds = LocalHolds(
            table, send, clock, lambda views, now: choose_step(
                views, now, delivery_latency_s=self.delivery_latency_s, safety_s=self.safety_s),
            max_reissues, monotonic=monotonic, ttl_s=ttl_s)
        self._fired: dict[str, tuple[float, dict[str, Finding]]] = {}
        """Subject -> (when the fast path last ordered for it, check -> finding it saw)."""
        self.orders_total: collections.Counter[tuple[str, str]] = collections.Counter()
        """``(job, reason) -> orders issued`` (reissues included)."""
        self.outcomes_total: collections.Counter[str] = collections.Counter()
        """``done``, ``superseded``, ``failed``, ``expired``, ``ended``."""
        self.deferred_total: collections.Counter[str] = collections.Counter()
        """Job -> fast-path orders left to the collector (the job spans nodes)."""
        self.last_duration: dict[str, float] = {}
        """Job -> seconds from the first order of a chain to the last rank's ``done``."""
        table.on_report(self.on_report)

    # -- issuing -------------------------------------------------------------------------
    def order_job(
        self,
        job: str,
        step: int | None = None,
        reason: str = "",
        request_id: str | None = None,
        *,
        origin: str = "collector",
    ) -> CheckpointOrder | None:
        """Order every local rank of ``job`` to save at ``step`` (chosen here when None).

        Returns the order, or None when no rank of the job is known on this node."""
        with self._lock:
            return self._issue(job, step, reason, request_id, origin, root=None, reissues=0)

    def advise_job(self, advice: IntervalAdvice) -> int:
        """Pass the collector's interval advice to every live local rank of its job;
        returns how many ranks it reached (hooks opted in with ``follow_advice`` obey it)."""
        with self._lock:
            now = self.clock()
            data = encode(advice)
            views = [v for v in self.table.job_views(advice.job) if self.table.alive(v, now)]
            return sum(1 for v in views if self.send(v.reply_to, data))

    def hold_job(self, hold: SaveHold) -> int:
        """Pass the collector's save hold (the job's state is suspect: stop saving) to every
        running local rank of its job, live or marked gone; returns how many it reached."""
        with self._lock:
            return self.holds.send_hold(hold)

    def hold_waiting(self, request_id: str) -> frozenset[int]:
        """Ranks a save hold has not reached yet (they get it on a later poll)."""
        with self._lock:
            return self.holds.waiting(request_id)

    def preempt_job(self, view: RankView) -> CheckpointOrder | None:
        """A rank of ``view.job`` got a preemption notice (table listener, ingest thread):
        order the whole job to save at the first step its fastest rank cannot have
        reported when the order lands (:func:`preempt_step`), once per notice
        round (ranks signalled together, twice, or a step apart share the order). Reason
        ``preempted: ...``: every rank that gets it exits after the save. A job with ranks
        on other nodes is left to its ranks' collective fallback (as the fast path)."""
        job = view.job
        with self._lock:
            self._end_replaced()
            if any(st.order.job == job and st.order.reason.startswith(PREEMPTED)
                   for st in self._orders.values()):
                return None
            views = self.table.job_views(job)
            if max((v.world_size for v in views), default=0) > len(views):
                self.deferred_total[job] += 1
                log.warning("job %s: rank %d got a preemption notice, but the job has ranks "
                            "on other nodes: no local order", job, view.rank)
                return None
            return self._issue(job, None, f"{PREEMPTED}: rank {view.rank} got a notice",
                               None, "local", None, 0)

    def _issue(self, job: str, step: int | None, reason: str, request_id: str | None,
               origin: str, root: str | None, reissues: int, floor: int | None = None
               ) -> CheckpointOrder | None:
        now = self.clock()
        known, live = job_ranks(self.table, job, now)  # why not only the live: order_ranks
        if not known:
            log.info("checkpoint order for job %s: no rank of it on this node", job)
            return None
        views = live or known
        chose = step is None
        if step is None and reason.startswith(PREEMPTED):
            step = preempt_step(views, now, reissues=reissues, floor=floor,
                                fallback_delivery_s=self.delivery_latency_s)
        elif step is None:
            step = choose_step(views, now, delivery_latency_s=self.delivery_latency_s,
                               safety_s=self.safety_s, margin_scale=2.0**reissues,
                               floor=floor)
        rid = request_id or f"fw-{uuid.uuid4().hex[:16]}"
        order = CheckpointOrder(request_id=rid, job=job, step=step, reason=reason[:4000],
                                issued=now)
        for old in list(self._orders.values()):
            if old.order.job == job and not old.closed:
                self._close(old, "superseded")
                if old.delivery.unsent:
                    self._trailing.append((job, old.delivery))
        st = OrderStatus(order=order, origin=origin, root=root or rid, agent_chose_step=chose,
                         expected=frozenset(v.rank for v in known),
                         delivery=Delivery.send(self.send, known, encode(order),
                                                self.monotonic()),
                         not_live=frozenset(v.rank for v in known) - {v.rank for v in live},
                         reissues=reissues)
        self._orders[rid] = st
        self.orders_total[(job, reason_label(reason, origin))] += 1
        unsent = st.delivery.unsent
        log.warning("checkpoint order %s: job %s saves at step %d (%s; %d local rank(s)%s)",
                    rid, job, step, reason or origin, len(known),
                    f", {len(unsent)} not delivered yet" if unsent else "")
        return order

    def _close(self, st: OrderStatus, why: str) -> None:
        st.closed = why
        self.outcomes_total[why] += 1
        self._orders.pop(st.order.request_id, None)

    # -- reports -------------------------------------------------------------------------
    def on_report(self, view: RankView | None, rep: CheckpointReport) -> None:
        """Table listener: a rank reported progress on an order (ingest thread)."""
        with self._lock:
            if self.holds.on_report(rep):
                return
            st = self._orders.get(rep.request_id)
            if st is None:
                return
            st.phases[rep.rank] = rep.phase
            st.delivery.unsent.discard(rep.rank)
            if rep.phase == "missed":
                self._missed(st, f"rank {rep.rank} was at step {rep.step} already", rep.step)
            elif rep.phase == "failed":
                log.error("checkpoint order %s: rank %d failed to save", rep.request_id, rep.rank)
                if all(st.phases.get(r) in ("done", "failed") for r in st.expected):
                    self._close(st, "failed")
            elif rep.phase == "done" and all(st.phases.get(r) == "done" for r in st.expected):
                st.done_seconds = self.monotonic() - st.delivery.issued_mono
                self.last_duration[st.order.job] = st.done_seconds
                log.info("checkpoint order %s: all %d local rank(s) of job %s saved step %d",
                         rep.request_id, len(st.expected), st.order.job, st.order.step)
                self._close(st, "done")

    def _missed(self, st: OrderStatus, why: str, floor: int | None = None) -> None:
        """Reissue an order the agent chose S for, past ``floor`` (the rank's step)."""
        if not st.agent_chose_step:
            log.warning("checkpoint order %s (step %d from %s): %s; left to the %s to reissue",
                        st.order.request_id, st.order.step, st.origin, why, st.origin)
            self._close(st, "failed")
            return
        if st.reissues >= self.max_reissues:
            log.error("checkpoint order %s: %s; gave up after %d reissues",
                      st.order.request_id, why, st.reissues)
            self._close(st, "failed")
            return
        log.warning("checkpoint order %s missed (%s): reissuing with a wider margin",
                    st.order.request_id, why)
        self._issue(st.order.job, None, st.order.reason, f"{st.root}-r{st.reissues + 1}",
                    st.origin, st.root, st.reissues + 1, floor)

    # -- every poll ----------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Retry undelivered orders and holds, detect lost orders, end old and replaced ones
        (poll thread)."""
        with self._lock:
            self.holds.tick()
            self._end_replaced()
            self._retry_trailing()
            for st in list(self._orders.values()):
                if st.closed:
                    continue
                if st.delivery.expired(self.monotonic(), self.ttl_s):
                    self._close(st, "expired")
                    continue
                job_views = self.table.job_views(st.order.job)
                st.delivery.retry(self.send, job_views)
                views = {v.rank: v for v in job_views}
                for rank in st.expected - st.delivery.unsent:  # undelivered: no sign of loss
                    v = views.get(rank)
                    if (v is not None and rank not in st.phases and v.last_step is not None
                            and v.last_step > st.order.step):
                        self._missed(st, f"rank {rank} went past step {st.order.step} "
                                         "without reporting (order lost)")
                        break

    def _retry_trailing(self) -> None:
        """Retry superseded orders' undelivered copies until delivered, past the time to
        live, or a rank's process is replaced (as an open order's)."""
        keep = []
        for job, d in self._trailing:
            views = self.table.job_views(job)
            if d.replaced(views) or d.expired(self.monotonic(), self.ttl_s):
                continue
            d.retry(self.send, views)
            if d.unsent:
                keep.append((job, d))
        self._trailing = keep

    def _end_replaced(self) -> None:
        """End the open orders a rank of which is no longer the process they were sent to
        (module docstring: a restarted job's new processes must not take them)."""
        for st in list(self._orders.values()):
            if st.delivery.replaced(self.table.job_views(st.order.job)):
                log.warning("checkpoint order %s: a rank of job %s restarted or left: ended",
                            st.order.request_id, st.order.job)
                self._close(st, "ended")

    def open_orders(self) -> list[OrderStatus]:
        with self._lock:
            return list(self._orders.values())

    def not_live(self, request_id: str) -> frozenset[int]:
        """Ranks an open order was issued to while they were not live (none once closed)."""
        with self._lock:
            st = self._orders.get(request_id)
            return st.not_live if st is not None else frozenset()

    def order_waiting(self, request_id: str) -> frozenset[int]:
        """Ranks an open order has not reached yet (retried on every poll; none once
        closed)."""
        with self._lock:
            st = self._orders.get(request_id)
            return frozenset(st.delivery.unsent) if st is not None else frozenset()

    # -- local fast path -------------------------------------------------------------------
    def jobs_on_gpu(self, gpu: int | None) -> list[str]:
        """Jobs with a rank on local GPU ``gpu`` (every job when None: a node finding)."""
        return sorted({v.job for v in self.table.views()
                       if gpu is None or self.gpu_of(v.local_rank) == gpu})

    def fast_path(self, findings: Iterable[Finding]) -> list[CheckpointOrder]:
        """Order checkpoints for local critical findings (see module doc); once per
        subject within ``cooldown_s``, unless a finding escalates its check's last one."""
        out = []
        mono = self.monotonic()
        for f in findings:
            if f.health != Health.UNHEALTHY:
                continue
            subj = f.subject
            if subj.kind in ("gpu", "node") and f.action in FAST_PATH_ACTIONS:
                jobs = self.jobs_on_gpu(subj.gpu if subj.kind == "gpu" else None)
            elif subj.kind == "rank" and f.check in RANK_FAST_PATH_CHECKS | RANK_HOLD_CHECKS:
                jobs = [subj.job]
            else:
                continue
            # One incident per subject: the findings one fault raises together (XID 48 and
            # the uncorrectable-ECC counter of one DBE) order once; a materially worse
            # finding of a check that already fired orders again (forewarn.escalation).
            key = subj.key()
            with self._lock:
                fired = self._fired.get(key)
                fresh = fired is None or mono - fired[0] >= self.cooldown_s
                if fired is not None and not fresh:
                    before = fired[1].get(f.check)
                    if before is None or not escalates(before, f):
                        fired[1].setdefault(f.check, f)  # joins the incident: no order
                        continue
                seen = {} if fired is None or fresh else fired[1]
                seen[f.check] = f
                self._fired[key] = (mono, seen)
                for job in jobs:
                    views = self.table.job_views(job)
                    world = max((v.world_size for v in views), default=0)
                    if world > len(views):
                        self.deferred_total[job] += 1
                        log.warning("%s: job %s has %d of its %d ranks on this node: its "
                                    "checkpoint or hold is left to the collector (a one-node "
                                    "save of a collective checkpoint would hang)", f.check, job,
                                    len(views), world)
                        continue
                    if f.check in RANK_HOLD_CHECKS:
                        self.holds.hold(job, f)
                        continue
                    order = self._issue(job, None, f"{f.check}: {f.reason}"[:4000], None,
                                        "local", None, 0)
                    if order is not None:
                        out.append(order)
        return out
