"""Webhooks queued but not delivered, resent by the next leader (issue 16).

The webhook sender's queue and its retries live in the leader's memory. What survives the
leader is in the ``actions`` table: every webhook the policy queued (``kind = 'webhook'``,
``status = 'queued'``, with the event it sends in ``detail.event``) and every delivery that
ended (``kind = 'webhook_delivery'``: ``delivered``, ``failed`` after its retries, or
``dropped`` when the queue was full), per endpoint url. A replica that starts to lead,
and a collector started again on its state, sends each event queued within
:data:`RESEND_WINDOW_S` to every endpoint where it has not ended, the same event with the
same ``id`` and idempotency key (its signature and timestamp are new, made as it is sent),
with the sender's full ``max_attempts``. The receiver drops the copy of one the old leader
delivered just before it died, before its delivery was stored, by its key.

The gates still count the queued webhook (:mod:`.gate_history`), so the finding is not
decided again: this resend is its one way out. Runs on the policy thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from forewarn.errors import UnavailableError

if TYPE_CHECKING:
    from ..storage.state import StateStore

__all__ = ["RESEND_WINDOW_S", "ResendDeadline", "resend_undelivered", "undelivered"]

log = logging.getLogger(__name__)

RESEND_WINDOW_S = 3600.0
"""How old a queued webhook may be and still be resent: the longest gate window with the
defaults (an older one's finding has been decided afresh since, or is long past news)."""
_QUEUED = ("SELECT id, detail FROM actions WHERE time >= ? AND kind = 'webhook'"
           " AND status = 'queued' ORDER BY time, id")
_ENDED = ("SELECT detail FROM actions WHERE time >= ? AND kind = 'webhook_delivery'"
          " AND status IN ('delivered', 'failed', 'dropped')")

Resend = Callable[[dict[str, Any], frozenset[str]], int]
"""Sends an event to the endpoints whose url is not in the set (the urls where it ended);
returns how many deliveries it queued (:meth:`.webhooks.WebhookSender.send`), or raises
:class:`ResendDeadline` when the time for the whole resend is up."""


class ResendDeadline(UnavailableError, TimeoutError):
    """The time given to the whole resend is up (the event loop that takes the events is
    wedged): this event and the ones after it are not sent now; they stay unended in the
    store, so the next leader (or this replica's next takeover) sends them."""


def undelivered(store: StateStore, since: float,
                skipped: Callable[[], object] = lambda: None
                ) -> list[tuple[dict[str, Any], frozenset[str]]]:
    """The events queued since ``since``, oldest first, each with the urls where its
    delivery ended. A row that cannot be read is skipped, logged naming the field, and
    counted (``skipped``); a row with no ``event`` at all (queued by a collector from
    before events were stored, within an hour of an upgrade) cannot be resent either, and
    is only logged, in one line."""
    ended: dict[str, set[str]] = {}
    for row in store.query(_ENDED, (since,)):
        detail = _object(row["detail"])
        if detail is not None:
            ended.setdefault(str(detail.get("event", "")), set()).add(str(detail.get("url")))
    out = []
    older = 0
    for row in store.query(_QUEUED, (since,)):
        detail = _object(row["detail"])
        if detail is not None and "event" not in detail:
            older += 1  # queued by a collector from before events were stored
            continue
        event = None if detail is None else detail.get("event")
        if not isinstance(event, dict) or not isinstance(event.get("id"), str):
            log.warning("webhook action %s not resent: detail.event is not an event with an"
                        " id", row["id"])
            skipped()
            continue
        out.append((event, frozenset(ended.get(event["id"], ()))))
    if older:
        # not the policy's error: an older collector did not store the event to resend
        log.warning("%d webhook(s) queued by an older collector stored no event and cannot"
                    " be sent again", older)
    return out


def resend_undelivered(store: StateStore, now: float, send: Resend,
                       skipped: Callable[[], object] = lambda: None) -> int:
    """Resend what :func:`undelivered` finds within :data:`RESEND_WINDOW_S` of ``now``,
    each event on its own: one that ``send`` fails on (a timeout handing it to the
    sender) is logged naming it and counted (``skipped``), stays unended in the store (the
    next leader tries it again) and the others still go out; once ``send`` raises
    :class:`ResendDeadline`, none of the rest is tried: they are counted (``skipped``,
    each) and logged in one line. Returns how many deliveries were queued again."""
    queued = 0
    pending = undelivered(store, now - RESEND_WINDOW_S, skipped)
    for n, (event, ended) in enumerate(pending):
        try:
            queued += send(event, ended)
        except ResendDeadline as exc:
            for _ in pending[n:]:
                skipped()
            log.warning("%d webhook(s) queued by the last leader not sent again (%s): left"
                        " unended for the next leader", len(pending) - n, exc)
            break
        except Exception:
            skipped()
            log.exception("webhook %s queued by the last leader not sent again", event["id"])
    if queued:
        log.warning("%d webhook delivery(ies) queued by the last leader and not ended:"
                    " sent again", queued)
    return queued


def _object(raw: Any) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None

