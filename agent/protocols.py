"""The agent's seams between its own parts, as ``typing.Protocol``\\ s passed explicitly.

The hardware seam is :mod:`forewarn.agent.backend` (:class:`GpuBackend`, :class:`XidSource`)
and a check's contract is :class:`forewarn.agent.checks.base.Check`; this module holds the
rest:

* :class:`Component`: a part of the agent written elsewhere (rank ingest, collector uplink)
  that the daemon starts, hands every poll cycle (:class:`Poll`) and stops. It sees the
  daemon as an :class:`AgentHost`. :class:`ComponentBase` gives every method a do-nothing
  default, so a component writes only what it needs.
* :class:`RankFeed` and :class:`OrderSink`: what the uplink needs of the training ranks
  (their summaries and checkpoint reports going up; the collector's orders, holds and
  advice coming down). ``forewarn agent`` hands the rank component's table and order book
  to the uplink when it builds both (:func:`forewarn.agent.build.build_components`).

Components
----------
Every method is called by :class:`forewarn.agent.daemon.Agent`::

    class MyComponent(ComponentBase):
        name = "mine"

        def start(self, agent: AgentHost) -> None:
            # once, after the registry and the exporter exist and before the first poll:
            # register Prometheus collectors (agent.registry.register(...)), start threads.
            ...

        def on_poll(self, poll: Poll) -> None:
            # on the poll thread after every cycle: this cycle's samples, XIDs, findings
            # and transitions. Keep it short (no blocking I/O): hand work to your own
            # thread. Exceptions are logged and counted, never fatal.
            ...

        def stop(self) -> None:
            # once at shutdown, in reverse order of start.
            ...

        def readiness(self) -> dict[str, Any] | None:
            # /readyz (any thread): {"ready": bool, "detail": str, ...} under the key
            # ``ready_name``, or None for nothing to report. A component whose start
            # raised is reported not ready with the error.
            ...

Components may publish findings of their own (a rank hang) with
:meth:`AgentHost.submit_findings` from any thread: they join the findings table at once
(``/api/v1/findings``, ``forewarn_finding_active``) and their transitions are delivered in
the next poll's ``transitions``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from forewarn.wire import (
    CheckpointOrder,
    CheckpointReport,
    Finding,
    GpuSample,
    Health,
    IntervalAdvice,
    RankSummary,
    SaveHold,
    XidEvent,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from forewarn.agent.checks.base import CheckRun
    from forewarn.agent.config import AgentConfig
    from forewarn.agent.state import AgentState

__all__ = [
    "AgentHost",
    "Component",
    "ComponentBase",
    "OrderSink",
    "Poll",
    "RankFeed",
    "Transition",
]


@dataclasses.dataclass(frozen=True)
class Transition:
    """A finding whose health or suggested action changed, that is new, or whose evidence
    grew materially worse than when it was last reported (:mod:`forewarn.escalation`)."""

    previous: Health | None
    """Health before; None when the check had not judged this subject before."""
    finding: Finding


@dataclasses.dataclass(frozen=True)
class Poll:
    """One poll cycle, handed to every component's ``on_poll``."""

    time: float
    samples: tuple[GpuSample, ...]
    xids: tuple[XidEvent, ...]
    """New XID events of this cycle (bus ids mapped to GPUs, cross-source duplicates dropped)."""
    findings: tuple[Finding, ...]
    """Every finding the checks returned this cycle (healthy ones too)."""
    transitions: tuple[Transition, ...]
    check_runs: tuple[CheckRun, ...]


class AgentHost(Protocol):
    """What a component sees of the agent (:class:`forewarn.agent.daemon.Agent`)."""

    @property
    def config(self) -> AgentConfig: ...

    @property
    def state(self) -> AgentState: ...

    @property
    def registry(self) -> CollectorRegistry:
        """Where a component registers its Prometheus collectors."""
        ...

    def submit_findings(self, findings: Iterable[Finding], *, check: str | None = None
                        ) -> None: ...


class Component(Protocol):
    """A part of the agent the daemon runs; see the module docstring."""

    @property
    def name(self) -> str:
        """Short, unique name (for logs)."""
        ...

    @property
    def ready_name(self) -> str:
        """The key of this component's part of ``/readyz``."""
        ...

    def start(self, agent: AgentHost) -> None: ...

    def on_poll(self, poll: Poll) -> None: ...

    def stop(self) -> None: ...

    def readiness(self) -> dict[str, Any] | None: ...


class ComponentBase:
    """Do-nothing defaults for every :class:`Component` method; ``ready_name`` is ``name``
    unless a subclass sets its own."""

    name = "component"

    @property
    def ready_name(self) -> str:
        return self.name

    def start(self, agent: AgentHost) -> None:
        """Nothing to start."""

    def on_poll(self, poll: Poll) -> None:
        """Nothing to do per cycle."""

    def stop(self) -> None:
        """Nothing to stop."""

    def readiness(self) -> dict[str, Any] | None:
        """Nothing to report."""
        return None


class RankFeed(Protocol):
    """The training ranks as the uplink reports them (the rank table)."""

    def summaries(self, node: str, now: float) -> list[RankSummary]: ...

    def drain_reports(self) -> list[CheckpointReport]:
        """Checkpoint reports received since the last call."""
        ...


class OrderSink(Protocol):
    """Where the collector's commands for the local ranks go (the order book)."""

    def order_job(self, job: str, step: int | None = None, reason: str = "",
                  request_id: str | None = None) -> CheckpointOrder | None:
        """Order the job's local ranks to save at ``step``; None when it has none here."""
        ...

    def not_live(self, request_id: str) -> frozenset[int]:
        """Ranks an open order waits for (they were not live when it came)."""
        ...

    def order_waiting(self, request_id: str) -> frozenset[int]:
        """Ranks an open order has not reached yet (retried on every poll)."""
        ...

    def hold_job(self, hold: SaveHold) -> int:
        """Pass a save hold to the job's local ranks; returns how many it reached."""
        ...

    def hold_waiting(self, request_id: str) -> frozenset[int]:
        """Ranks a save hold has not reached yet (retried on every poll)."""
        ...

    def advise_job(self, advice: IntervalAdvice) -> int:
        """Pass interval advice to the job's local ranks; returns how many it reached."""
        ...
