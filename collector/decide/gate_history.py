"""The policy's gates rebuilt from the store (:meth:`.gates.Gates.restore`): when a replica
starts to lead (shared state: another replica decided until then) and when a collector
starts on its state, before it decides anything.

What counts is what was done, read from the ``decisions`` rows within the gates' window
(:meth:`~.gates.Gates.window_s`):

* a decision ``act`` or ``shadow`` passed every gate: a cooldown, a token, a breaker
  target; ``refused``: the breaker was tripped;
* a checkpoint order, a save hold or a webhook counts only once its ``actions`` row is
  stored (written as it was queued). A leader that died between the decision and queueing
  its order leaves the finding to the next leader, which decides it again: the same
  finding gives the same order id (:func:`~.orders.order_key`) and the same webhook
  idempotency key (:func:`~.actions.decision_key`), so doing it twice is harmless and
  not doing it would lose it;
* a drain counts from its decision: its ``actions`` row comes only when its command has
  ended, and a node must not be drained twice;
* the breaker's own alert (target ``breaker:<kind>``) passed no gate and counts for none;
* "one checkpoint order per job and incident" and "one save hold per job and incident"
  (:class:`~.incidents.IncidentBook`): the open incidents are taken over from the
  ``incidents`` table (:mod:`.ledger`), and which jobs each one ordered (held) from the
  checkpoint (hold) decisions carried out (their ``incident`` input). An order's incident
  the table never had (the leader died after it queued the order and before it stored
  its incidents, or that write failed) is opened again from the decision, which keeps
  the finding it decided (its ``finding`` input): the fault's next finding joins it
  instead of opening an incident that orders the job a second time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from forewarn.wire import Finding

from .gates import GateEvent
from .incidents import IncidentBook, StoredAct
from .severity import ActionKind

if TYPE_CHECKING:
    from ..storage.state import StateStore
    from .policy import Policy
    from .seam import DecideContext

__all__ = ["restore_gates", "restore_incident_actions", "stored_acts", "stored_events"]

log = logging.getLogger(__name__)

_DECISIONS = ("SELECT id, time, decision, inputs FROM decisions WHERE time >= ? AND"
              " (decision LIKE '%:act' OR decision LIKE '%:shadow') ORDER BY time, id")
_REFUSALS = ("SELECT decision, MAX(time) AS time FROM decisions WHERE time >= ? AND"
             " decision LIKE '%:refused' GROUP BY decision")
"""The last refusal per kind is all a breaker's trip needs (a storm refuses many)."""
_CARRIED_OUT = ("SELECT detail FROM actions WHERE time >= ? AND kind IN"
                " ('checkpoint', 'hold', 'webhook')")
_ORDERED = ("SELECT time, job, inputs FROM decisions WHERE time >= ? AND decision IN"
            " ('checkpoint:act', 'checkpoint:shadow') ORDER BY time, id")
_HELD = ("SELECT time, job, inputs FROM decisions WHERE time >= ? AND decision IN"
         " ('hold:act', 'hold:shadow') ORDER BY time, id")
_INCIDENTS = "SELECT id FROM incidents WHERE updated >= ?"
"""The incidents stored (any state): an order's incident updated as it was decided."""
_QUEUED_KINDS = frozenset({ActionKind.CHECKPOINT, ActionKind.HOLD, ActionKind.WEBHOOK})


def restore_gates(policy: Policy, ctx: DecideContext) -> None:
    """Rebuild ``policy``'s gates from ``ctx``'s store; a store that fails leaves them as
    they were, a row that cannot be read is skipped (both logged and counted in
    ``forewarn_collector_policy_errors_total``)."""
    now = ctx.clock()
    try:
        events = stored_events(ctx.store, now - policy.gates.window_s(),
                               ctx.metrics.policy_errors.inc)
    except Exception:
        ctx.metrics.policy_errors.inc()
        log.exception("rebuilding the policy's gates from the store failed")
        return
    policy.gates.restore(events, now)
    log.warning("policy gates rebuilt from %d stored decision(s)", len(events))
    try:
        restore_incident_actions(policy.incidents, ctx.store, now - policy.gates.window_s())
    except Exception:
        ctx.metrics.policy_errors.inc()
        log.exception("taking over which jobs the open incidents ordered failed")


def restore_incident_actions(book: IncidentBook, store: StateStore, since: float) -> None:
    """Which jobs ``book``'s incidents ordered and held, from the checkpoint orders and
    save holds carried out since ``since`` (an incident the store never had is opened
    again from them: :meth:`~.incidents.IncidentBook.ordered_before`)."""
    for act in stored_acts(store, since):
        book.ordered_before(act)
    for act in stored_acts(store, since, _HELD):
        book.held_before(act)


def stored_acts(store: StateStore, since: float, decisions: str = _ORDERED
                ) -> list[StoredAct]:
    """The checkpoint orders (``decisions``: or the save holds, :data:`_HELD`) carried out
    since ``since``, oldest first: "one checkpoint order (save hold) per job and incident"
    holds on the next leader. Each names the finding decided when the ``incidents`` table
    does not have its incident. A row that cannot be read is skipped."""
    carried = _carried_out(store.query(_CARRIED_OUT, (since,)))
    stored = {str(row["id"]) for row in store.query(_INCIDENTS, (since,))}
    out = []
    for row in store.query(decisions, (since,)):
        try:
            inputs = json.loads(row["inputs"])
        except ValueError:
            continue
        if not isinstance(inputs, dict) or inputs.get("id") not in carried:
            continue
        incident, onset = str(inputs.get("incident", "")), inputs.get("onset_step")
        check = inputs.get("check")  # as stored: a null check stays None, not "None"
        out.append(StoredAct(
            incident=incident, job=str(row["job"]), time=float(row["time"]),
            check=check if isinstance(check, str) else None,
            source=str(inputs.get("source", "agent")),
            onset=onset if isinstance(onset, int) else None,
            finding=None if incident in stored else _finding(inputs.get("finding"))))
    return out


def _finding(value: Any) -> Finding | None:
    """The finding a decision stored (:meth:`.policy.Policy` keeps it with an order or a
    hold), or None (none stored, or not one)."""
    try:
        return msgspec.convert(value, Finding) if isinstance(value, dict) else None
    except msgspec.ValidationError:
        return None


def stored_events(store: StateStore, since: float,
                  skipped: Callable[[], object] = lambda: None) -> list[GateEvent]:
    """What the gates remember from the rows stored since ``since``: the actions oldest
    first, then each breaker's last refusal (see the module docstring). A row that cannot
    be read is skipped, logged naming the field, and counted (``skipped``)."""
    carried = _carried_out(store.query(_CARRIED_OUT, (since,)))
    events: list[GateEvent] = []
    for row in store.query(_DECISIONS, (since,)):
        try:
            event = _event(row, carried)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("decision row %s skipped while rebuilding the gates: %s",
                        row.get("id"), exc)
            skipped()
            continue
        if event is not None:
            events.append(event)
    for row in store.query(_REFUSALS, (since,)):
        try:
            kind = ActionKind(str(row["decision"]).partition(":")[0])
        except ValueError:
            continue
        events.append(GateEvent(time=float(row["time"]), kind=kind, target="", acted=False))
    return events


def _carried_out(rows: Sequence[dict[str, Any]]) -> set[str]:
    """Ids of the decisions whose ``actions`` row is stored."""
    out: set[str] = set()
    for row in rows:
        try:
            detail = json.loads(row["detail"])
        except ValueError:
            continue
        if isinstance(detail, dict) and isinstance(detail.get("decision"), str):
            out.add(detail["decision"])
    return out


def _event(row: dict[str, Any], carried: set[str]) -> GateEvent | None:
    kind = ActionKind(str(row["decision"]).partition(":")[0])
    inputs = json.loads(row["inputs"])
    if not isinstance(inputs, dict):
        raise ValueError(f"inputs: a JSON object expected, got {type(inputs).__name__}")
    target = inputs["target"]
    if not isinstance(target, str):
        raise TypeError(f"inputs.target: a string expected, got {type(target).__name__}")
    if target.startswith("breaker:"):
        return None
    if kind in _QUEUED_KINDS and inputs.get("id") not in carried:
        return None
    return GateEvent(time=float(row["time"]), kind=kind, target=target)
