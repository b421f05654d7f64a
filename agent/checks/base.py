"""The interface every check implements, and the runner that keeps a bad check from
taking the agent down (checks report, they don't raise)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, Subject, SuggestedAction

__all__ = ["Check", "CheckRun", "run_checks"]

log = logging.getLogger(__name__)


class Check(Protocol):
    """A health check over the agent's state.

    Contract: ``name`` is unique and stable (it becomes a metric label). ``applies``
    says whether the check can say anything on this node (e.g. NVLink on a PCIe-only
    GPU: no). ``run`` returns findings for the subjects it judged, including healthy
    ones when it has something to clear, and never raises on bad data.
    """

    name: str

    def applies(self, state: AgentState) -> bool: ...

    def run(self, state: AgentState, now: float) -> list[Finding]: ...


@dataclasses.dataclass(frozen=True)
class CheckRun:
    """How one check did on one poll: for the check's own success/duration metrics."""

    name: str
    ok: bool
    seconds: float
    findings: tuple[Finding, ...]


def run_checks(
    checks: Sequence[Check],
    state: AgentState,
    now: float,
    *,
    timer: Callable[[], float] = time.perf_counter,
) -> list[CheckRun]:
    """Run every applicable check; a check that raises yields an ``unknown`` finding.

    ``timer`` measures each check's duration (injectable so exposition tests are exact).
    """
    runs = []
    for check in checks:
        start = timer()
        try:
            if not check.applies(state):
                continue
            findings = tuple(check.run(state, now))
            ok = True
        except Exception as exc:  # a check must never take the agent down
            log.exception("check %s failed", check.name)
            findings = (
                Finding(
                    check=check.name,
                    health=Health.UNKNOWN,
                    subject=Subject(kind="node", node=state.node),
                    reason=f"check {check.name} failed: {type(exc).__name__}: {exc}"[:4000],
                    action=SuggestedAction.NONE,
                    time=now,
                ),
            )
            ok = False
        runs.append(CheckRun(check.name, ok, timer() - start, findings))
    return runs
