"""Long policy work in parts, each its own item on the policy thread, so that urgent work
(an agent's fatal finding) runs between them instead of after the whole.

A scoring of the fleet (features of every GPU, the model's probabilities, its findings
through the policy) takes seconds on a loaded machine. :class:`PartRunner` runs such work
written as a generator, one ``yield`` between parts: each part is queued with
``submit_next`` (:meth:`~.policy_thread.PolicyThread.submit_next`: first on the decision
lane, urgent items before it), so the parts of one pass follow each other with only urgent
work between them and the state they share stays the policy thread's alone (no locks). The
first part is queued too: a pass found due while a telemetry batch is handled does not run
inside that batch's item. One pass at a time: a pass asked for while one runs is dropped
(the next is due again after this one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any, TypeVar

__all__ = ["PartRunner", "run_whole"]

log = logging.getLogger(__name__)

Parts = Generator[None, None, Any]
"""Work in parts: a ``yield`` between two parts."""

T = TypeVar("T")


def run_whole(parts: Generator[None, None, T]) -> T:
    """Every part of ``parts`` at once (in the caller's item); what the work returns."""
    while True:
        try:
            next(parts)
        except StopIteration as done:
            result: T = done.value
            return result


class PartRunner:
    """Runs one :data:`Parts` pass at a time on the policy thread (module docstring).

    ``submit_next`` queues a part (the policy thread's ``submit_next``); ``failed`` counts
    a part that raised (logged; the pass ends, the next one starts afresh)."""

    def __init__(self, submit_next: Callable[[Callable[[], None]], object],
                 failed: Callable[[], None]) -> None:
        self._submit = submit_next
        self._failed = failed
        self._pass: Parts | None = None

    def run(self, parts: Parts) -> None:
        """Policy thread: queue ``parts``' first part, unless a pass is under way."""
        if self._pass is not None:
            parts.close()
            return
        self._pass = parts
        self._queue()

    def _queue(self) -> None:
        try:
            self._submit(self._step)
        except RuntimeError:  # the policy thread is shutting down: the pass ends here
            self.cancel()

    def _step(self) -> None:
        """One part; the next one queued behind whatever urgent work came meanwhile."""
        parts = self._pass
        if parts is None:
            return
        try:
            next(parts)
        except StopIteration:
            self._pass = None
            return
        except Exception:  # bad data never wedges the policy: this pass ends, counted
            self._pass = None
            self._failed()
            log.exception("a scoring pass failed")
            return
        self._queue()

    def cancel(self) -> None:
        """End the pass under way, if any (its parts not run yet are dropped)."""
        parts, self._pass = self._pass, None
        if parts is not None:
            parts.close()
