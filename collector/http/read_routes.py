"""Read-API routes answered by the policy (``GET /api/v1/risk``, ``GET /api/v1/goodput``,
built by :mod:`.policy_routes`): the same bearer-token rule as the app's own read API
(``api_token`` when configured) and JSON answers encoded with msgspec. The query-parameter
and read-token helpers here serve the app's own read API too (:mod:`forewarn.collector.http.api`).

The handler runs on the policy thread (``ctx.run_policy``), so it reads the policy's state
without locks; keep it cheap.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..ingest.validate import IngestError
from .auth import parse_bearer

if TYPE_CHECKING:
    from .context import CollectorContext

__all__ = ["QueryError", "check_reader", "float_param", "int_param", "policy_read_route"]


class QueryError(IngestError):
    """A bad query parameter; answered with 400 and this message (counted as a ``decode``
    rejection where the app's :func:`~forewarn.collector.http.api.handled` answers it)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, "decode", message)


def check_reader(ctx: CollectorContext, request: Request) -> None:
    """Refuse (401) a read without the configured ``api_token`` as bearer token."""
    if not ctx.config.api_token:
        return
    token = parse_bearer(request.headers.get("authorization")) or ""
    if not hmac.compare_digest(token.encode(), ctx.config.api_token.encode()):
        raise IngestError(401, "auth", "read API: missing or wrong bearer token")


def float_param(request: Request, name: str, lo: float = -math.inf,
                hi: float = math.inf) -> float | None:
    """Query parameter ``name`` as a finite float within ``lo..hi`` (``None`` when absent).
    NaN and infinities are refused: NaN compares false with everything, so a filter on it
    would answer an empty list instead of saying what is wrong."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise QueryError(f"query parameter {name}: not a number") from None
    if not math.isfinite(value):
        raise QueryError(f"query parameter {name}: not a finite number")
    if not lo <= value <= hi:
        raise QueryError(f"query parameter {name}: must be within {lo:g}..{hi:g}")
    return value


def int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    """Query parameter ``name`` as an integer within ``lo..hi``."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise QueryError(f"query parameter {name}: not an integer") from None
    if not lo <= value <= hi:
        raise QueryError(f"query parameter {name}: must be within {lo}..{hi}")
    return value


def policy_read_route(
    path: str, fn: Callable[[CollectorContext, Request, float], Any]
) -> Route:
    """``GET path`` answering ``fn(ctx, request, now)`` (run on the policy thread) as JSON."""

    async def endpoint(request: Request) -> Response:
        ctx: CollectorContext = request.app.state.ctx
        try:
            check_reader(ctx, request)
            data = await ctx.run_policy(fn, ctx, request, ctx.clock())
        except IngestError as exc:  # a refused token (401) or a QueryError (400)
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        return Response(msgspec.json.encode(data), media_type="application/json")

    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return Route(path, endpoint, methods=["GET"])
