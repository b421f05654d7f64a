"""The policy's gates and their memory: a cooldown per action kind and target, a rate
limit (:class:`~.limits.TokenBucket`) per kind and a circuit breaker
(:class:`~.limits.CircuitBreaker`) per kind that has a share.

The memory is what the policy did: when it acted (or recorded a shadow action) on which
target, and when a breaker refused. The store keeps all of it in the ``decisions`` table,
so a replica that starts to lead, or a collector started again on its state, rebuilds its
gates from there (:meth:`Gates.restore`, fed by :mod:`.gate_history`) and holds back what
the previous leader's gates would have held back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .limits import CircuitBreaker, TokenBucket
from .severity import ActionKind

if TYPE_CHECKING:
    from .policy import PolicySettings

__all__ = ["GateEvent", "Gates"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GateEvent:
    """One stored outcome the gates remember: ``acted`` (an action done or shadowed passed
    every gate: it starts a cooldown, takes a token and counts in the breaker) or a
    breaker's refusal."""

    time: float
    kind: ActionKind
    target: str
    acted: bool = True


class Gates:
    """The gates' state for ``settings``, as of ``now`` (see the module docstring).

    Not thread-safe: the policy's, on its thread.
    """

    def __init__(self, settings: PolicySettings, now: float) -> None:
        self.settings = settings
        self.cooldowns: dict[tuple[ActionKind, str], float] = {}
        self.buckets = self._buckets(now)
        self.breakers = {
            kind: CircuitBreaker(share, settings.breaker_window_s, settings.breaker_min)
            for kind in ActionKind
            if (share := settings.breaker_share.get(kind.value)) is not None
        }

    def _buckets(self, now: float) -> dict[ActionKind, TokenBucket]:
        s = self.settings
        return {kind: TokenBucket(s.rate_per_minute.get(kind.value, 60.0) / 60.0,
                                  s.burst.get(kind.value, 10.0), now)
                for kind in ActionKind}

    def cooldown_s(self, kind: ActionKind) -> float:
        """The cooldown of ``kind`` (0: none)."""
        return self.settings.cooldown_s.get(kind.value, 0.0)

    def acted(self, kind: ActionKind, target: str, now: float) -> None:
        """An action on ``target`` passed every gate: its cooldown starts, the breaker
        counts it. (Its token was taken by the rate limit's check.)"""
        self.cooldowns[(kind, target)] = now
        breaker = self.breakers.get(kind)
        if breaker is not None:
            breaker.note(target, now)

    def window_s(self) -> float:
        """How far back the gates remember: the longest cooldown or breaker window, and at
        least the time a bucket takes to fill again (a bucket that never fills, rate 0,
        is taken as full at the window's start)."""
        s = self.settings
        rates = {k: s.rate_per_minute.get(k.value, 60.0) / 60.0 for k in ActionKind}
        fill = [s.burst.get(k.value, 10.0) / rate for k, rate in rates.items() if rate > 0]
        return max([s.breaker_window_s, *s.cooldown_s.values(), *fill])

    def restore(self, events: Iterable[GateEvent], now: float) -> None:
        """Replace the gates' state with what ``events`` (the actions oldest first, within
        :meth:`window_s` of ``now``) say: cooldowns from the last action per target, the
        breakers' targets and trips, the buckets replayed from full at the window's start
        (a bucket is full again after its fill time, so that is exact unless the
        window's start fell inside a burst). An event stored after ``now`` (another
        replica's clock ran ahead of this one's) counts as at ``now``: its cooldown, token
        and breaker entry would otherwise hold for the skew on top (logged)."""
        start = now - self.window_s()
        fresh = Gates(self.settings, start)
        events = list(events)
        ahead = max((e.time - now for e in events), default=0.0)
        if ahead > 0:
            log.warning("policy gates: a stored decision's time is %.1f s ahead of this "
                        "replica's clock (clock skew between replicas?): counted as now",
                        ahead)
        for e in (dataclasses.replace(e, time=min(e.time, now)) for e in events):
            breaker = fresh.breakers.get(e.kind)
            if not e.acted:
                if breaker is not None:
                    breaker.refused(e.time)
                continue
            fresh.buckets[e.kind].take(e.time)
            fresh.acted(e.kind, e.target, e.time)
        self.cooldowns, self.buckets, self.breakers = (
            fresh.cooldowns, fresh.buckets, fresh.breakers)

    def prune(self, now: float) -> None:
        """Forget cooldowns that have run out."""
        self.cooldowns = {k: t for k, t in self.cooldowns.items()
                          if t >= now - self.cooldown_s(k[0])}
