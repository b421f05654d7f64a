"""HTTP helpers shared by the collector's routes, the read API, ``/metrics``, ``/healthz``
and the OpenAPI document. The routes are mounted by :func:`forewarn.collector.http.app.create_app`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from forewarn.wire import AgentBatch, Command, CommandAck, Finding

from ..ingest.batch import finding_rows_json
from ..ingest.validate import IngestError, count_rejection
from ..jobs.jobmap import job_detail, list_jobs
from .read_routes import QueryError, check_reader, float_param, int_param

if TYPE_CHECKING:
    from .context import CollectorContext

__all__ = [
    "agent_node",
    "ctx_of",
    "error_response",
    "float_param",
    "handled",
    "json_response",
    "openapi_schema",
    "read_limited",
    "read_routes",
]


# -- helpers ---------------------------------------------------------------------------


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status_code=status,
                    media_type="application/json")


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise IngestError(400, "decode", "Content-Length: not a number")
        if int(declared) > limit:
            raise IngestError(413, "too_large",
                              f"body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise IngestError(413, "too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def ctx_of(request: Request) -> CollectorContext:
    ctx: CollectorContext = request.app.state.ctx
    return ctx


def agent_node(ctx: CollectorContext, request: Request) -> str:
    node = ctx.tokens.authenticate(request.headers.get("authorization"))
    if node is None:
        missing = "authorization" not in request.headers
        raise IngestError(401, "auth", "missing bearer token" if missing
                          else "token not recognised")
    return node


def handled(fn: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn :class:`IngestError` into a JSON 4xx/5xx and count it."""

    async def wrapper(request: Request) -> Response:
        try:
            response: Response = await fn(request)
            return response
        except IngestError as exc:
            if request.url.path == "/api/v1/ingest":
                count_rejection(ctx_of(request).metrics, exc)
            else:
                ctx_of(request).metrics.rejected.labels(exc.reason).inc()
            return error_response(exc.status, str(exc))

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


# -- read API --------------------------------------------------------------------------


def reader(sql_fn: Callable[[CollectorContext, Request], Any]) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        ctx = ctx_of(request)
        check_reader(ctx, request)
        data = await asyncio.to_thread(sql_fn, ctx, request)
        if data is None:
            return error_response(404, f"not found: {request.url.path}")
        return json_response(data)

    endpoint.__name__ = sql_fn.__name__
    endpoint.__doc__ = sql_fn.__doc__
    return handled(endpoint)


def filtered(table: str, order: str, filters: Sequence[str], time_col: str | None = "time",
             most: int = 10_000) -> Callable[[CollectorContext, Request], Any]:
    """Rows of ``table`` matching the query's ``filters``, newest ``limit`` (at most
    ``most``) in ``order``."""
    def fn(ctx: CollectorContext, request: Request) -> Any:
        where: list[str] = []
        params: list[Any] = []
        for name in filters:
            value = request.query_params.get(name)
            if value is not None:
                where.append(f"{name} = ?")
                params.append(value)
        if time_col is not None:
            since = float_param(request, "since")
            if since is not None:
                where.append(f"{time_col} >= ?")
                params.append(since)
        limit = int_param(request, "limit", 500, 1, most)
        sql = f"SELECT * FROM {table}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {order} LIMIT ?"
        rows = ctx.store.query(sql, [*params, limit])
        if table == "incidents":
            return _incident_rows_json(rows)
        return finding_rows_json(rows) if table == "findings" else rows

    fn.__name__ = table
    return fn


def _incident_rows_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Expand the stored JSON list of an incident's tracked findings."""
    for row in rows:
        row["findings"] = json.loads(row["findings"])
    return rows


def _nodes(ctx: CollectorContext, request: Request) -> Any:
    """Nodes that have sent batches, with their last batch."""
    return ctx.store.query("SELECT * FROM nodes ORDER BY node")


def _jobs(ctx: CollectorContext, request: Request) -> Any:
    """Jobs in the job map."""
    return list_jobs(ctx.store)


def _job(ctx: CollectorContext, request: Request) -> Any:
    """One job with its ranks (node, GPU) and checkpoints, named by the ``name`` query
    parameter: any name the wire accepts fits there percent-encoded, where a path segment
    cannot carry ``..``, ``.`` or a newline."""
    name = request.query_params.get("name")
    if name is None:
        raise QueryError("query parameter name: required (the job's name)")
    return job_detail(ctx.store, name)


def _job_by_path(ctx: CollectorContext, request: Request) -> Any:
    """One job, named in the path (names a URL path can carry; see :func:`_job`)."""
    return job_detail(ctx.store, request.path_params["job"])


def _command_log(ctx: CollectorContext, request: Request) -> Any:
    """Commands with delivery and acknowledgement state."""
    return ctx.commands.list(node=request.query_params.get("node"),
                             limit=int_param(request, "limit", 500, 1, 10_000))


async def metrics_endpoint(request: Request) -> Response:
    """The exposition of what the collector already knows: never a store query, so a
    scrape answers while the database is down (when an operator needs it most)."""
    ctx = ctx_of(request)
    return Response(ctx.metrics.exposition(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


async def healthz(request: Request) -> Response:
    ctx = ctx_of(request)
    try:
        await asyncio.to_thread(ctx.store.scalar, "SELECT 1")
    except Exception as exc:  # the database is gone: say so, do not die
        return error_response(503, f"store: {exc}")
    return json_response({"ok": True, "schema": ctx.store.schema_version})


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI 3.1 document (record schemas generated from :mod:`forewarn.wire`)."""
    (batch, command, ack, finding), components = msgspec.json.schema_components(
        [AgentBatch, Command, CommandAck, Finding], ref_template="#/components/schemas/{name}")
    err = {"description": "refused; the message names the problem",
           "content": {"application/json": {"schema": {
               "type": "object", "properties": {"error": {"type": "string"}}}}}}
    rows = {"description": "rows", "content": {"application/json": {"schema": {
        "type": "array", "items": {"type": "object"}}}}}
    listing = {"limit": "int, default 500", "since": "Unix time", "name": "the job's name"}

    def read(summary: str, params: Sequence[str] = ()) -> dict[str, Any]:
        return {"get": {"summary": summary, "parameters": [
            {"name": p, "in": "query", "required": False, "schema": {"type": "string"},
             "description": listing.get(p, "")} for p in params],
            "responses": {"200": rows, "401": err}}}

    def operator(summary: str, key: str) -> dict[str, Any]:
        body = {"type": "object", "required": [key], "properties": {
            key: {"type": "string"}, "reason": {"type": "string"}}}
        return {"post": {"summary": summary, "security": [{"operatorToken": []}],
                         "requestBody": {"required": True,
                                         "content": {"application/json": {"schema": body}}},
                         "responses": {"200": {"description": "the policy's decisions"},
                                       "400": err, "401": err, "403": err}}}

    paths: dict[str, Any] = {
        "/api/v1/ingest": {"post": {
            "summary": "Agent batch (msgpack), exactly once per (agent_id, seq)",
            "security": [{"agentToken": []}],
            "requestBody": {"required": True,
                            "content": {"application/msgpack": {"schema": batch}}},
            "responses": {"200": {"description": "stored or duplicate"}, "400": err,
                          "401": err, "403": err, "413": err, "415": err}}},
        "/api/v1/commands": {"get": {
            "summary": "Long poll for this node's commands",
            "security": [{"agentToken": []}],
            "parameters": [{"name": "node", "in": "query", "schema": {"type": "string"}},
                           {"name": "wait", "in": "query", "schema": {"type": "number"}}],
            "responses": {"200": {"description": "commands", "content": {
                "application/json": {"schema": {"type": "array", "items": command}}}},
                "401": err, "403": err}}},
        "/api/v1/commands/{id}/ack": {"post": {
            "summary": "Acknowledge a command", "security": [{"agentToken": []}],
            "parameters": [{"name": "id", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "requestBody": {"content": {"application/json": {"schema": ack}}},
            "responses": {"200": {"description": "acked or already"}, "404": err}}},
        "/api/v1/orders": operator("Order a job to checkpoint (operator)", "job"),
        "/api/v1/drains": operator("Drain a node (operator; shadow until drain_enabled)",
                                   "node"),
        "/api/v1/nodes": read("Nodes"),
        "/api/v1/gpus": read("GPUs with their latest sample and health (limit up to "
                             "100,000)", ["node", "limit"]),
        "/api/v1/jobs": read("Jobs: state (running, finished, stopped), ranks alive and "
                             "finished, health of their GPUs"),
        "/api/v1/job": read("One job by name (any name the wire accepts): ranks on "
                            "nodes/GPUs, checkpoints", ["name"]),
        "/api/v1/jobs/{job}": read("One job named in the path (names a path can carry)"),
        "/api/v1/findings": read("Findings",
                                 ["node", "job", "health", "check_name", "since", "limit"]),
        "/api/v1/incidents": read(
            "Incidents: correlated findings about one GPU, node or job, each with its tracked "
            "findings (id, key, state firing/resolved/expired)",
            ["state", "kind", "node", "job", "since", "limit"]),
        "/api/v1/xids": read("XID events", ["node", "code", "since", "limit"]),
        "/api/v1/actions": read("Actions", ["kind", "job", "node", "since", "limit"]),
        "/api/v1/decisions": read("Policy decisions with inputs", ["job", "since", "limit"]),
        "/api/v1/checkpoints": read("Checkpoint reports", ["job", "node", "since", "limit"]),
        "/api/v1/commands/log": read("Commands and their acknowledgements", ["node", "limit"]),
        "/metrics": {"get": {"summary": "Prometheus metrics",
                             "responses": {"200": {"description": "text exposition"}}}},
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "ok"}}}},
        "/readyz": {"get": {"summary": "Readiness per component (storage, ingest, flush)",
                            "responses": {"200": {"description": "ready"},
                                          "503": {"description": "not ready"}}}},
    }
    components["Finding"] = components.get("Finding", finding)
    return {
        "openapi": "3.1.0",
        "info": {"title": "forewarn collector", "version": "1"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "agentToken": {"type": "http", "scheme": "bearer"},
            "operatorToken": {"type": "http", "scheme": "bearer"}}},
    }


async def openapi(request: Request) -> Response:
    return json_response(openapi_schema())


def read_routes() -> list[Route]:
    """The read API, ``/openapi.json``, ``/metrics`` and ``/healthz``."""
    return [
        Route("/api/v1/commands/log", reader(_command_log), methods=["GET"]),
        Route("/api/v1/nodes", reader(_nodes), methods=["GET"]),
        # the status page draws every GPU of the fleet: up to 100,000 in one answer
        Route("/api/v1/gpus", reader(filtered("gpus", "node, gpu", ["node"], None, 100_000)),
              methods=["GET"]),
        Route("/api/v1/jobs", reader(_jobs), methods=["GET"]),
        Route("/api/v1/job", reader(_job), methods=["GET"]),
        # ``path``: a job name may contain "/" (sent percent-encoded, decoded by the server)
        Route("/api/v1/jobs/{job:path}", reader(_job_by_path), methods=["GET"]),
        Route("/api/v1/findings", reader(filtered(
            "findings", "time DESC, id DESC", ["node", "job", "health", "check_name"])),
            methods=["GET"]),
        Route("/api/v1/incidents", reader(filtered(
            "incidents", "updated DESC", ["state", "kind", "node", "job"], "updated")),
            methods=["GET"]),
        Route("/api/v1/xids", reader(filtered("xids", "time DESC, id DESC",
                                                ["node", "code"])), methods=["GET"]),
        Route("/api/v1/actions", reader(filtered("actions", "time DESC, id DESC",
                                                   ["kind", "job", "node"])), methods=["GET"]),
        Route("/api/v1/decisions", reader(filtered("decisions", "time DESC, id DESC",
                                                     ["job"])), methods=["GET"]),
        Route("/api/v1/checkpoints", reader(filtered("checkpoints", "time DESC, id DESC",
                                                       ["job", "node"])), methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
