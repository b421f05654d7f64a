"""The order book rebuilt from the store (:meth:`.orders.OrderBook.restore`): when a replica
starts to lead (shared state: another replica issued the orders until then) and when a
collector starts on its state, so that a rank reporting an earlier order's step missed is
answered with the order again, and an order's progress stays readable.

What the book follows comes from three tables, as of the last :data:`RESTORE_WINDOW_S`:

* ``commands``: every checkpoint order and save hold as it was queued, one row per node
  (the order itself, its nodes, each node's acknowledgement);
* ``actions``: which decision issued an order, and which order a reissue replaced (with
  its attempt), so an order reissued already is not reissued again and the reissues stay
  bounded by ``order_max_reissues``; a hold's replacement names the hold it ``replaces``;
* ``checkpoints``: the ranks' reports (started, done, failed, missed) for each order and
  hold; a miss the old leader had not answered (it died first) is kept for the new leader
  to answer (:meth:`.actions.ActionPipeline.reissue_missed`).

An order whose job has left the job map is not taken back (nothing could be reissued for
it). Runs on the policy thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from forewarn.wire import CheckpointOrder, CheckpointReport, Command, SaveHold, WireError, decode

from .orders import JobOrder

if TYPE_CHECKING:
    from ..jobs.jobview import JobInfo, JobView
    from ..storage.state import StateStore
    from .orders import OrderBook
    from .seam import DecideContext

__all__ = ["RESTORE_WINDOW_S", "StoredOrders", "restore_orders", "stored_orders"]

log = logging.getLogger(__name__)

RESTORE_WINDOW_S = 3600.0
"""How far back orders are taken over: the command queue's time to live (an older order
is no longer delivered, its ranks saved or missed it long since)."""
_COMMANDS = ("SELECT id, node, body, acked_at, ok FROM commands WHERE created >= ? AND"
             " kind IN ('checkpoint', 'hold') ORDER BY created, id")
_ACTIONS = ("SELECT status, detail FROM actions WHERE time >= ? AND kind = 'checkpoint'"
            " AND status IN ('ordered', 'reissued') ORDER BY time, id")
_REPORTS = ("SELECT request_id, rank, step, phase FROM checkpoints WHERE time >= ?"
            " AND request_id <> '' ORDER BY time")


@dataclasses.dataclass
class StoredOrders:
    """What the store says the book follows: orders and holds, each with its job."""

    orders: dict[str, tuple[JobOrder, JobInfo]] = dataclasses.field(default_factory=dict)
    holds: list[tuple[SaveHold, int, JobInfo]] = dataclasses.field(default_factory=list)
    misses: list[CheckpointReport] = dataclasses.field(default_factory=list)
    """Misses not answered (the old leader died first): per order still ``issued`` and per
    hold not replaced, the missed report of the furthest rank."""


def restore_orders(book: OrderBook, ctx: DecideContext) -> None:
    """Rebuild ``book`` from ``ctx``'s store; a store that fails leaves it as it was, a
    command that cannot be read is skipped (both logged and counted in
    ``forewarn_collector_policy_errors_total``)."""
    try:
        stored = stored_orders(ctx.store, ctx.jobs, ctx.clock() - RESTORE_WINDOW_S,
                               ctx.metrics.policy_errors.inc)
    except Exception:
        ctx.metrics.policy_errors.inc()
        log.exception("rebuilding the order book from the store failed")
        return
    book.restore(stored.orders.values(), stored.holds, stored.misses)
    log.warning("order book rebuilt from the store: %d order(s), %d hold(s), %d miss(es)"
                " to answer", len(stored.orders), len(stored.holds), len(stored.misses))


def stored_orders(store: StateStore, jobs: JobView, since: float,
                  skipped: Callable[[], object] = lambda: None) -> StoredOrders:
    """The orders and holds queued since ``since`` with their progress (see the module
    docstring). A command that cannot be read is skipped, logged naming the field, and
    counted (``skipped``)."""
    out = StoredOrders()
    hold_attempts: dict[str, int] = {}
    replaced: set[str] = set()
    for row in store.query(_COMMANDS, (since,)):
        try:
            command = decode(bytes(row["body"]), Command)
        except WireError as exc:
            log.warning("command %s skipped while rebuilding the order book: %s", row["id"], exc)
            skipped()
            continue
        if command.order is not None:
            _queued_order(out, command.order, row, jobs)
        elif command.hold is not None and command.hold.request_id not in hold_attempts:
            hold = command.hold
            job = jobs.job(hold.job)
            attempt = hold_attempts.get(hold.replaces, -1) + 1 if hold.replaces else 0
            hold_attempts[hold.request_id] = attempt
            replaced.add(hold.replaces)
            if job is not None:
                out.holds.append((hold, attempt, job))
    out.holds = [h for h in out.holds if h[0].request_id not in replaced]
    _link(out.orders, store.query(_ACTIONS, (since,)))
    reports = store.query(_REPORTS, (since,))
    _progress(out.orders, reports)
    out.misses = _unanswered(out, reports)
    return out


def _unanswered(out: StoredOrders, rows: Sequence[dict[str, Any]]) -> list[CheckpointReport]:
    """The misses nobody answered (see :attr:`StoredOrders.misses`): an answered one made
    its order ``reissued`` or its hold replaced."""
    jobs = {o.request_id: o.job for o, _ in out.orders.values() if o.status == "issued"}
    jobs.update((h.request_id, h.job) for h, _, _ in out.holds)
    furthest: dict[str, CheckpointReport] = {}
    for row in rows:
        request_id = str(row["request_id"])
        if row["phase"] != "missed" or request_id not in jobs:
            continue
        known = furthest.get(request_id)
        if known is None or int(row["step"]) > known.step:
            furthest[request_id] = CheckpointReport(
                job=jobs[request_id], rank=int(row["rank"]), request_id=request_id,
                step=int(row["step"]), phase="missed", time=0.0)
    return list(furthest.values())


def _queued_order(out: StoredOrders, order: CheckpointOrder, row: dict[str, Any],
                  jobs: JobView) -> None:
    """One node's command of ``order``: the order (once), its node and acknowledgement."""
    known = out.orders.get(order.request_id)
    if known is None:
        job = jobs.job(order.job)
        if job is None:
            return
        known = (JobOrder(request_id=order.request_id, job=order.job, step=order.step,
                          reason=order.reason, issued=order.issued, nodes=(),
                          world_size=job.world_size, inputs={"restored": True}), job)
        out.orders[order.request_id] = known
    record = known[0]
    record.nodes = (*record.nodes, str(row["node"]))
    if row["acked_at"] is not None:
        record.acks[str(row["node"])] = bool(row["ok"])


def _link(orders: dict[str, tuple[JobOrder, JobInfo]],
          rows: Sequence[dict[str, Any]]) -> None:
    """Decision ids, reissues (the replaced order ``reissued``) and attempts."""
    for row in rows:
        try:
            detail = json.loads(row["detail"])
        except ValueError:
            continue
        if not isinstance(detail, dict):
            continue
        known = orders.get(str(detail.get("request_id")))
        if known is not None and row["status"] == "ordered":
            known[0].decision_id = str(detail.get("decision", ""))
        if row["status"] != "reissued":
            continue
        old = orders.get(str(detail.get("replaces")))
        if old is not None:
            old[0].status = "reissued"
        if known is not None and isinstance(detail.get("attempt"), int):
            known[0].attempt = detail["attempt"]
            if old is not None:
                known[0].decision_id = old[0].decision_id


def _progress(orders: dict[str, tuple[JobOrder, JobInfo]],
              rows: Sequence[dict[str, Any]]) -> None:
    """The ranks' reports, as :meth:`.orders.OrderBook.on_report` took them (without
    reissuing: a miss the old leader answered is answered by a ``reissued`` action)."""
    for row in rows:
        known = orders.get(str(row["request_id"]))
        if known is None or known[0].status != "issued":
            continue
        order = known[0]
        order.ranks[int(row["rank"])] = str(row["phase"])
        order.rank_steps[int(row["rank"])] = int(row["step"])
        if row["phase"] == "failed":
            order.status = "failed"
        elif sum(1 for p in order.ranks.values() if p == "done") >= order.world_size:
            order.status = "done"
