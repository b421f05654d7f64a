r"""When one rank saves: the checkpoint orders it holds until their steps, the agreement
collective, and the decision at each ``should_checkpoint`` (:class:`Saves`).

Checkpoint orders ("every rank of job J saves at step S") arrive from the agent on the
rank's own socket. If this rank has not reported step S yet, ``should_checkpoint`` returns
True at step S. If S has already passed, the rank reports ``missed`` with its current step
and the agent issues a new S. So every rank that received the same orders before their
steps saves at the same steps. Orders never replace each other (the agent's fast path and
the collector can both order a job for one finding): each order's step gets its save, one
save serves every order for the same step. With ``agree_every=k`` an order is not held
here at once: :func:`agree` (every k steps, all ranks; one tiny collective, and on NCCL one
device sync) ``all_reduce(MAX)``\ es the pending order step and a preemption flag over the
default process group, and every rank holds the agreed step.

:class:`DueOrders` keeps the orders; :class:`Saves` decides and reports each save.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable

from forewarn import wire

from ._numerics import Numerics
from ._preempt import PREEMPT_REQUEST, is_preemption
from ._preempt_state import NONE, PENDING, SAVING, PreemptState
from ._preempt_step import preempt_step
from ._reporter import Reporter

__all__ = ["DueOrders", "Saves", "agree", "agreeing"]

Entry = tuple[str, str]
"""``(request_id, reason)`` of one order."""


class DueOrders:
    """Orders held until their steps (``next_due`` is what the hot path reads)."""

    def __init__(self, job: str, lock: threading.Lock, agree_every: int) -> None:
        self.job = job
        self.agree_every = agree_every
        self.due: dict[int, list[Entry]] = {}
        self.next_due: int | None = None
        self.agree_pending: tuple[int, str, str] | None = None
        self.accepted = self.ignored = self.invalid = self.missed = 0
        self.lock = lock
        self._seen: collections.deque[str] = collections.deque(maxlen=64)

    def on_order(self, order: wire.CheckpointOrder, last_step: int | None) -> bool | None:
        """Take an order (background thread): True when held until its step, False when
        its step has passed (report ``missed``), None when ignored or left to agreement."""
        if order.job != self.job or order.request_id in self._seen:
            self.ignored += 1
            return None
        self._seen.append(order.request_id)
        with self.lock:
            if self.agree_every > 0:
                pend = self.agree_pending
                if pend is None or order.step >= pend[0]:
                    self.agree_pending = (order.step, order.request_id, order.reason)
                self.accepted += 1
                return None
            if last_step is None or last_step < order.step:
                self.add(order.step, order.request_id, order.reason)
                self.accepted += 1
                return True
        return False

    def add(self, step: int, request_id: str, reason: str) -> None:
        """Hold an order until its step (caller holds the lock)."""
        self.due.setdefault(step, []).append((request_id, reason))
        self.next_due = step if self.next_due is None else min(self.next_due, step)

    def take(self, step: int) -> tuple[list[str], list[Entry]]:
        """The request ids whose steps passed unsaved, and the orders due at ``step``."""
        with self.lock:
            passed = sorted(s for s in self.due if s < step)
            missed = [rid for s in passed for rid, _ in self.due.pop(s)]
            now = self.due.pop(step, [])
            self.next_due = min(self.due, default=None)
        return missed, now

    def take_until(self, step: int) -> list[str]:
        """Request ids of every order due by ``step`` (saves are held: refused)."""
        with self.lock:
            due = [rid for s in sorted(s for s in self.due if s <= step)
                   for rid, _ in self.due.pop(s)]
            self.next_due = min(self.due, default=None)
        return due

    def clear(self) -> None:
        """Forget every order (the preemption save comes first, then the exit)."""
        with self.lock:
            self.due.clear()
            self.next_due = None


def agreeing(agree_every: int) -> bool:
    """Agreement mode is on and the default process group is up (a process group exists
    only once the user imported torch.distributed: nothing is imported here)."""
    dist = sys.modules.get("torch.distributed") if agree_every > 0 else None
    return dist is not None and bool(dist.is_available() and dist.is_initialized())


def agree(orders: DueOrders, step: int, notice: bool) -> None:
    """All ranks: ``all_reduce(MAX)`` of the pending order step (or -1) and of the
    preemption notice (``notice``: this rank's); every rank holds the agreed step."""
    import torch
    import torch.distributed as dist

    with orders.lock:
        pend, orders.agree_pending = orders.agree_pending, None
    value = pend[0] if pend is not None else -1
    noticed = notice or (pend is not None and is_preemption(pend[2]))
    if noticed:
        value = max(value, step + 1)
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    # [order step, preemption notice]: a notice on any rank preempts every rank
    t = torch.tensor([value, int(noticed)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    agreed, preempted = (int(x) for x in t.tolist())
    if agreed < 0:
        return
    target = max(agreed, step + 1)  # every rank computes the same target
    rid, reason = (pend[1], pend[2]) if pend is not None else ("", "agreed")
    if preempted:
        rid, reason = rid or PREEMPT_REQUEST, PREEMPT_REQUEST
    with orders.lock:
        orders.add(target, rid, reason)


class Saves:
    """When this rank saves, and the reports of each save: the preemption save, held saves,
    the advised interval and the due orders (what ``Monitor.should_checkpoint`` asks), then
    ``started``/``done``/``failed``/``missed`` reports under each order's request id."""

    def __init__(self, orders: DueOrders, out: Reporter, pre: PreemptState,
                 numerics: Numerics, monotonic: Callable[[], float],
                 follow_advice: bool) -> None:
        self.orders = orders
        self.follow_advice = follow_advice
        self.advice: wire.IntervalAdvice | None = None
        self.checkpoints = 0
        self._active: tuple[str, ...] | None = None  # request ids of the save under way
        self._out = out
        self._pre = pre
        self._numerics = numerics
        self._mono = monotonic

    def should(self, step: int, connected: bool) -> bool:
        """True when this rank must save now, at ``step``."""
        pre, orders = self._pre, self.orders
        if (pre.stage == PENDING and pre.save_alone(agreeing(orders.agree_every), connected)
                and step >= self._save_at(step)):
            orders.clear()  # the preemption save comes first, then the exit
            pre.stage = SAVING
            self._start(step, (PREEMPT_REQUEST,))
            return True
        next_due = orders.next_due
        if self._numerics.saves_held(step):
            if next_due is not None and step >= next_due:
                why = f"held: the training state is suspect since step {self._numerics.onset}"
                for rid in orders.take_until(step):
                    self._out.checkpoint(step, "failed", rid, path=why)
            return False
        advice = self.advice
        if (self.follow_advice and advice is not None and step >= advice.from_step
                and (step - advice.from_step) % advice.every_steps == 0 and next_due != step):
            self._start(step, ("advised",))
            return True
        if next_due is None or step < next_due:
            return False
        missed, now = orders.take(step)
        for rid in missed:
            self.report_missed(step, rid)
        if not now:
            return False
        if any(is_preemption(r) for _, r in now):
            # the job-wide preemption save (this rank may not have been signalled itself):
            # checkpoint_done() then exits the process
            if pre.stage == NONE:
                # the order is this rank's notice: its own signal, arriving during the save,
                # is a repeat within the grace, not a reason to die mid-save
                pre.since = self._mono()
            pre.stage = SAVING
        self._start(step, tuple(rid for rid, _ in now))
        return True

    def _save_at(self, step: int) -> int:
        """The step of this rank's own preemption save (decided once, at the first ask)."""
        if self._pre.save_at is None:
            self._pre.save_at = preempt_step(self.orders.job, step)
        return self._pre.save_at

    def _start(self, step: int, request_ids: tuple[str, ...]) -> None:
        self._active = request_ids
        for rid in request_ids:
            self._out.checkpoint(step, "started", rid)

    def finish(self, step: int, phase: str, path: str, seconds: float | None = None,
               nbytes: int | None = None) -> None:
        """Report the save under way ``done`` or ``failed`` (under each of its orders)."""
        rids, self._active = self._active or ("",), None
        if phase == "done":
            self.checkpoints += 1
            seconds, nbytes = max(0.0, float(seconds or 0)), max(0, int(nbytes or 0))
        for rid in rids:
            self._out.checkpoint(step, phase, rid, seconds=seconds, nbytes=nbytes,
                                 path=str(path)[:4096])

    def report_missed(self, step: int, request_id: str) -> None:
        """An order's (or a hold's) step had passed: the issuer issues it again."""
        self.orders.missed += 1
        self._out.checkpoint(step, "missed", request_id)

    def on_order(self, order: wire.CheckpointOrder, last_step: int | None) -> None:
        """An order from the agent (background thread)."""
        held = self.orders.on_order(order, last_step)
        if held and is_preemption(order.reason):
            self._pre.order_due = True
        elif held is False:
            self.report_missed(last_step if last_step is not None else 0, order.request_id)
