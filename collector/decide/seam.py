"""The seam between the HTTP layer and the decide layer: what a policy is given and what it
offers, typed here so that nothing in ``decide/`` imports the HTTP layer.

A policy is any object with ``on_findings`` (:class:`FindingsPolicy`) and optionally any of
the hooks :class:`StartHook`, :class:`StopHook`, :class:`BatchHook`, :class:`AckHook`,
:class:`FeedHook` and :class:`ApiHook`; :func:`forewarn.collector.http.app.create_app`
tells by ``isinstance`` which ones a policy has (a method set to ``None`` counts as absent)
and calls those.

The policy sees the running service through :class:`DecideContext`, which the HTTP layer's
``CollectorContext`` implements. Routes are built by the HTTP layer only: a policy that
answers requests says so with :meth:`ApiHook.api`, a :class:`PolicyApi` of plain callables
(:mod:`forewarn.collector.http.policy_routes` mounts a route for each one set).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from forewarn.wire import AgentBatch, CommandAck, Finding

if TYPE_CHECKING:
    import httpx

    from ..config import CollectorConfig
    from ..ingest.alerts import AlertPayload
    from ..jobs.jobmap import StoreJobView
    from ..metrics import CollectorMetrics
    from ..storage.commands import CommandQueue, NodeCommand
    from ..storage.leader import Leadership
    from ..storage.state import StateStore

__all__ = [
    "AckHook", "AlertHandler", "ApiHook", "BatchHook", "DecideContext", "FeedHook",
    "FindingsPolicy",
    "ForcedHandler", "PolicyApi", "RiskQuery", "StartHook", "StopHook",
]

T = TypeVar("T")


class DecideContext(Protocol):
    """The running service as the policy sees it (the HTTP layer's ``CollectorContext``)."""

    # Read-only properties: the context's dataclass fields satisfy them, and the policy
    # never rebinds the service's parts.

    @property
    def config(self) -> CollectorConfig: ...

    @property
    def store(self) -> StateStore: ...

    @property
    def metrics(self) -> CollectorMetrics:
        """``metrics.registry`` takes the policy's own metrics."""
        ...

    @property
    def commands(self) -> CommandQueue:
        """The agents' command queues (``order_checkpoint``, ``enqueue_many``)."""
        ...

    @property
    def jobs(self) -> StoreJobView: ...

    @property
    def outbound(self) -> httpx.AsyncClient | None:
        """The injected client for webhooks (``None``: each sender makes its own)."""
        ...

    @property
    def clock(self) -> Callable[[], float]:
        """Unix time now."""
        ...

    @property
    def leader(self) -> Leadership:
        """Whether this replica decides now (``is_leader``) and whether the state is shared
        with other replicas (``shared``): a follower's policy decides nothing."""
        ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The app's event loop once it started (``None`` in a service without one)."""
        ...

    async def run_policy(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the policy thread (serialised with every hook call)."""
        ...

    def submit_bulk(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` on the policy thread's bulk lane (runs while nothing else waits)."""
        ...

    def submit_next(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` first on the policy thread's decision lane (urgent work still
        before it): the next part of the item in progress."""
        ...


class FindingsPolicy(Protocol):
    """What :func:`~forewarn.collector.http.app.create_app` needs of a policy."""

    def on_findings(
        self, findings: Sequence[Finding], store: StateStore, now: float
    ) -> Sequence[NodeCommand] | None:
        """Newly stored findings; the commands returned are queued for their agents."""


# The optional hooks: runtime_checkable so that create_app tells which ones a policy has
# by isinstance (a method set to None counts as absent), and mypy checks each signature.


@runtime_checkable
class StartHook(Protocol):
    """A policy started with the app."""

    def start(self, ctx: DecideContext) -> None:
        """At app start-up, on the policy thread, before any other hook call."""


@runtime_checkable
class StopHook(Protocol):
    """A policy stopped with the app."""

    def stop(self) -> None:
        """At app shutdown, on the policy thread; an exception is ignored."""


@runtime_checkable
class BatchHook(Protocol):
    """A policy that hears every stored batch."""

    def on_batches(self, batches: Sequence[AgentBatch], now: float) -> None:
        """Newly stored batches (leader only: every batch on the bus, whichever replica
        stored it), before their findings reach ``on_findings``."""


@runtime_checkable
class AckHook(Protocol):
    """A policy that hears the agents' acknowledgements."""

    def on_ack(self, ack: CommandAck, node: str) -> None:
        """An acknowledgement from ``node``'s agent (leader only)."""


@runtime_checkable
class FeedHook(Protocol):
    """A policy that tells findings apart by where they came in (shared state)."""

    def on_feed(self, found: Sequence[tuple[str, Finding]], now: float) -> None:
        """Findings any replica stored, each with its origin, read by the leader's feed
        (leader only; without this hook they go to ``on_findings``)."""

    def settled(self) -> bool:
        """Whether every finding handed to :meth:`on_feed` has been decided (some wait
        on a lane of their own: alerts). Until it is, the feed's saved cursor stays
        before them, so a next leader reads them again. Any thread."""


@dataclasses.dataclass(frozen=True)
class RiskQuery:
    """``GET /api/v1/risk``'s parameters."""

    node: str | None = None
    """Only this node's GPUs."""
    floor: float = 0.0
    """Only GPUs at or above this probability."""
    limit: int = 1000
    """At most this many GPUs, the riskiest first."""


AlertHandler = Callable[[DecideContext, "AlertPayload", str], Awaitable[dict[str, Any]]]
"""One authenticated, decoded alert webhook: ``(ctx, payload, source)`` -> the JSON answer."""

ForcedHandler = Callable[[DecideContext, list[Finding], str], Awaitable[dict[str, Any]]]
"""Store findings and run them through the policy with the cost model bypassed (an
operator asked): ``(ctx, findings, source)`` -> the JSON answer (the decisions taken)."""


@dataclasses.dataclass(frozen=True)
class PolicyApi:
    """What a policy answers over HTTP; a route is mounted for each callable set.

    ``risk`` and ``goodput`` run on the policy thread, so they read the policy's state
    without locks: keep them cheap."""

    alert_token: str = ""
    """Bearer token of the alert webhooks (none: they refuse every request, 403)."""
    alerts: AlertHandler | None = None
    """``POST /api/v1/alerts/alertmanager`` and ``/api/v1/alerts/grafana``."""
    operator_token: str = ""
    """Bearer token of the operator's actions (none: they refuse every request, 403)."""
    operator: ForcedHandler | None = None
    """``POST /api/v1/orders`` and ``/api/v1/drains``."""
    risk: Callable[[DecideContext, RiskQuery, float], Any] | None = None
    """``GET /api/v1/risk``: ``(ctx, query, now)`` -> the JSON answer."""
    goodput: Callable[[str | None, float], Any] | None = None
    """``GET /api/v1/goodput``: ``(job or None for all, now)`` -> the JSON answer."""


@runtime_checkable
class ApiHook(Protocol):
    """A policy that answers requests (the HTTP layer builds the routes)."""

    def api(self) -> PolicyApi:
        """What to mount; called once, when the app is built."""
