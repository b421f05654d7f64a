"""The routes of the policy's :class:`~forewarn.collector.decide.seam.PolicyApi`: the HTTP
layer builds them, the policy only hands over plain callables.

* ``POST /api/v1/alerts/alertmanager`` and ``/api/v1/alerts/grafana`` (``alerts``): require
  ``Authorization: Bearer <alert_token>``; with no token they refuse every request (403).
  The body (at most :data:`~forewarn.collector.ingest.alerts.MAX_ALERT_BODY` bytes) is
  decoded by :func:`~forewarn.collector.ingest.alerts.parse_alerts`.
* ``POST /api/v1/orders`` and ``/api/v1/drains`` (``operator``): :mod:`.operator`.
* ``GET /api/v1/risk`` (``risk``; query ``node``, ``min``: a probability, 0..1, ``limit``) and
  ``GET /api/v1/goodput`` (``goodput``; query ``job``): read routes answered on the policy
  thread (:func:`~.read_routes.policy_read_route`).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from ..decide.seam import AlertHandler, DecideContext, PolicyApi, RiskQuery
from ..ingest.alerts import MAX_ALERT_BODY, parse_alerts
from .operator import operator_routes
from .read_routes import float_param, int_param, policy_read_route

if TYPE_CHECKING:
    from .context import CollectorContext

__all__ = ["alert_routes", "policy_routes"]


def policy_routes(api: PolicyApi) -> list[BaseRoute]:
    """A route for each callable ``api`` sets."""
    out: list[BaseRoute] = []
    if api.alerts is not None:
        out += alert_routes(api.alerts, api.alert_token)
    if api.operator is not None:
        out += operator_routes(api.operator, api.operator_token)
    if api.risk is not None:
        out.append(policy_read_route("/api/v1/risk", _risk_reader(api.risk)))
    if api.goodput is not None:
        out.append(policy_read_route("/api/v1/goodput", _goodput_reader(api.goodput)))
    return out


def _risk_reader(risk: Callable[[DecideContext, RiskQuery, float], Any]
                 ) -> Callable[[CollectorContext, Request, float], Any]:
    def risk_route(ctx: CollectorContext, request: Request, now: float) -> Any:
        """Latest failure probability per GPU and per job."""
        query = RiskQuery(node=request.query_params.get("node"),
                          floor=float_param(request, "min", 0.0, 1.0) or 0.0,
                          limit=int_param(request, "limit", 1000, 1, 100_000))
        return risk(ctx, query, now)

    return risk_route


def _goodput_reader(goodput: Callable[[str | None, float], Any]
                    ) -> Callable[[CollectorContext, Request, float], Any]:
    def goodput_route(ctx: CollectorContext, request: Request, now: float) -> Any:
        """Per job goodput, lost time by cause and checkpoint interval advice."""
        return goodput(request.query_params.get("job"), now)

    return goodput_route


def _authorized(request: Request, token: str) -> bool:
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(
        value.strip().encode(), token.encode()
    )


def alert_routes(handler: AlertHandler, token: str) -> list[Route]:
    """The two alert webhook routes, authenticated with ``token``."""

    def endpoint(source: str) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def handle(request: Request) -> JSONResponse:
            if not token:
                return JSONResponse(
                    {"error": "alert webhooks are disabled: set alert_token"}, status_code=403
                )
            if not _authorized(request, token):
                return JSONResponse(
                    {"error": "missing or wrong bearer token"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > MAX_ALERT_BODY:
                return JSONResponse({"error": "body too large"}, status_code=413)
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_ALERT_BODY:
                    return JSONResponse({"error": "body too large"}, status_code=413)
            try:
                payload = parse_alerts(body)
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            ctx: CollectorContext = request.app.state.ctx
            return JSONResponse(await handler(ctx, payload, source))

        return handle

    return [
        Route("/api/v1/alerts/alertmanager", endpoint("alertmanager"), methods=["POST"]),
        Route("/api/v1/alerts/grafana", endpoint("grafana"), methods=["POST"]),
    ]
