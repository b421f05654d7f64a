"""Operator actions over HTTP: a person orders a job to checkpoint or a node drained.

``POST /api/v1/orders`` with ``{"job": "<job>", "reason": "..."}`` and ``POST
/api/v1/drains`` with ``{"node": "<node>", "reason": "..."}`` (JSON, at most
:data:`MAX_BODY` bytes) require ``Authorization: Bearer <operator_token>``. Each becomes a
:class:`~forewarn.wire.Finding` (check ``operator:order`` / ``operator:drain``) that goes
through the one policy with the cost model bypassed, like an alert rule's: dedup,
cooldown, rate limits, the circuit breaker and shadow mode still apply, and drain stays
shadow until ``drain_enabled``. The answer lists the decisions taken.

The operator token is distinct from every other token: node tokens (an agent acts on its
own node's jobs only, :mod:`..ingest.authz`), the read token (``api_token``) and the alert token.
A request bearing a node's token is refused with 403 even if it matched, and the
collector does not start when ``operator_token`` equals ``api_token`` or ``alert_token``
(:class:`~forewarn.collector.config.CollectorConfig`). With no operator token configured
the routes refuse every request (403): security by default. Refusals are counted in
``forewarn_collector_ingest_rejected_total{reason="operator_auth"}``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from forewarn.wire import Finding, Health, Subject, SuggestedAction

from ..decide.seam import ForcedHandler
from ..ingest.validate import IngestError
from .api import read_limited
from .auth import parse_bearer

if TYPE_CHECKING:
    from .context import CollectorContext

__all__ = ["MAX_BODY", "OperatorRequest", "check_operator", "operator_routes"]

MAX_BODY = 64 * 1024


class OperatorRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of an operator action: the job (orders) or node (drains) and why. A drain
    may name the GPU that is pulled (``gpu``, its index): the drain is then about that GPU,
    and once it ran, retraining reads it as that GPU's failure (docs/models.md)."""

    job: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    node: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    gpu: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""


def check_operator(ctx: CollectorContext, request: Request, token: str) -> None:
    """Refuse (403 without an operator token or with a node's token, 401 otherwise) a
    request that does not bear ``token``."""
    header = request.headers.get("authorization")
    if not token:
        raise IngestError(403, "operator_auth",
                          "operator actions are disabled: set operator_token")
    node = ctx.tokens.authenticate(header)
    if node is not None:
        raise IngestError(403, "operator_auth",
                          f"node {node!r}'s token cannot act as the operator")
    given = parse_bearer(header) or ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise IngestError(401, "operator_auth", "missing or wrong operator token")


def _finding(kind: str, body: OperatorRequest, now: float) -> Finding:
    if kind == "order":
        if body.job is None or body.node is not None:
            raise IngestError(400, "decode", "$.job: an order names one job (and no node)")
        if body.gpu is not None:
            raise IngestError(400, "decode", "$.gpu: an order names a job, not a GPU")
        subject = Subject(kind="job", job=body.job)
        action = SuggestedAction.CHECKPOINT
    else:
        if body.node is None or body.job is not None:
            raise IngestError(400, "decode", "$.node: a drain names one node (and no job)")
        subject = (Subject(kind="node", node=body.node) if body.gpu is None
                   else Subject(kind="gpu", node=body.node, gpu=body.gpu))
        action = SuggestedAction.DRAIN
    reason = f"operator {kind}: {body.reason}".strip().rstrip(":")
    return Finding(check=f"operator:{kind}", health=Health.UNHEALTHY, subject=subject,
                   reason=reason, action=action, time=now)


def operator_routes(submit: ForcedHandler, token: str) -> list[Route]:
    """``POST /api/v1/orders`` and ``POST /api/v1/drains``, authorised with ``token``."""
    def endpoint(kind: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            ctx: CollectorContext = request.app.state.ctx
            try:
                check_operator(ctx, request, token)
                raw = await read_limited(request, MAX_BODY)
                try:
                    body = msgspec.json.decode(raw, type=OperatorRequest)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    raise IngestError(400, "decode", f"invalid {kind} request: {exc}") from None
                finding = _finding(kind, body, ctx.clock())
            except IngestError as exc:
                ctx.metrics.rejected.labels(exc.reason).inc()
                return JSONResponse({"error": str(exc)}, status_code=exc.status)
            return JSONResponse(await submit(ctx, [finding], "operator"))

        return handle

    return [
        Route("/api/v1/orders", endpoint("order"), methods=["POST"]),
        Route("/api/v1/drains", endpoint("drain"), methods=["POST"]),
    ]
