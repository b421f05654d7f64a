"""The agent's table of current findings and the transitions it records.

Checks (each poll) and components (any thread) put their judgements here; the table keeps
the latest finding per ``(check, subject)`` and says which changed: new, another health or
suggested action, or evidence materially worse than when last reported
(:mod:`forewarn.escalation`). Those :class:`~forewarn.agent.protocols.Transition`\\ s are
what the uplink sends and the fast path acts on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import msgspec

from forewarn.agent.protocols import Transition
from forewarn.escalation import escalates
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["FindingsTable"]

_WORST_FIRST = {Health.UNHEALTHY: 0, Health.DEGRADED: 1, Health.UNKNOWN: 2, Health.HEALTHY: 3}


class FindingsTable:
    """Current findings by ``(check, subject key)``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._findings: dict[tuple[str, str], Finding] = {}
        self._reported: dict[tuple[str, str], Finding] = {}
        """The finding of each key last reported as a transition (the escalation base)."""
        self._pending: list[Transition] = []

    def update(self, runs: Iterable[tuple[str, Iterable[Finding]]], now: float
               ) -> tuple[list[Transition], tuple[Finding, ...]]:
        """Take every check's complete judgement of this poll (``(check, findings)``):
        returns the transitions (those submitted since the last poll first) and every
        current finding."""
        with self._lock:
            transitions = self._pending
            self._pending = []
            for check, findings in runs:
                transitions.extend(self._update(check, findings, now))
            return transitions, tuple(self._findings.values())

    def submit(self, findings: Iterable[Finding], now: float, *, check: str | None = None
               ) -> None:
        """Findings from a component; their transitions go out with the next
        :meth:`update`. With ``check``, ``findings`` is that check's complete current
        judgement: its subjects not listed are dropped."""
        items = list(findings)
        with self._lock:
            if check is not None:
                self._pending.extend(self._update(check, items, now))
                return
            for name in sorted({f.check for f in items}):
                self._pending.extend(self._update(
                    name, [f for f in items if f.check == name], now, drop_missing=False))

    def current(self) -> list[Finding]:
        """Every current finding (a copy), worst first."""
        with self._lock:
            items = list(self._findings.values())
        return sorted(items, key=lambda f: (_WORST_FIRST[f.health], f.subject.key(), f.check))

    def not_healthy(self) -> int:
        """How many current findings are not healthy."""
        with self._lock:
            return sum(1 for f in self._findings.values() if f.health != Health.HEALTHY)

    def _update(self, check: str, findings: Iterable[Finding], now: float,
                drop_missing: bool = True) -> list[Transition]:
        out = []
        seen = set()
        for f in findings:
            key = (f.check, f.subject.key())
            seen.add(key)
            old = self._findings.get(key)
            self._findings[key] = f
            reported = self._reported.get(key)
            if (old is None or old.health != f.health or old.action != f.action
                    or (reported is not None and escalates(reported, f))):
                # Materially worse evidence under the same health (remapped rows growing
                # under "remap pending") is re-reported too: forewarn.escalation.
                out.append(Transition(old.health if old else None, f))
                self._reported[key] = f
        if drop_missing:
            out.extend(self._drop(check, seen, now))
        return out

    def _drop(self, check: str, seen: set[tuple[str, str]], now: float) -> list[Transition]:
        """Forget ``check``'s subjects it no longer judges; a not-healthy one is cleared
        to unknown (a transition), so nobody keeps acting on it."""
        out = []
        for key in [k for k in self._findings if k[0] == check and k not in seen]:
            old = self._findings.pop(key)
            self._reported.pop(key, None)
            if old.health != Health.HEALTHY:
                cleared = msgspec.structs.replace(
                    old, health=Health.UNKNOWN, action=SuggestedAction.NONE, time=now,
                    reason=f"{check} no longer judges this subject (was: {old.reason})"[:4000],
                )
                out.append(Transition(old.health, cleared))
        return out
