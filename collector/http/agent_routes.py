"""The agents' endpoints: ``POST /api/v1/ingest`` (a batch), ``GET /api/v1/commands`` (the
long poll) and ``POST /api/v1/commands/{id}/ack``; their contract is in
:mod:`forewarn.collector.http.app`'s docstring. Each authenticates the node's token."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from forewarn.wire import (
    MAX_UNIX_TIME,
    SENT_AT_HEADER,
    AgentBatch,
    CommandAck,
    WireError,
    decode,
    decode_json,
)

from ..ingest.batch import IngestResult, accept_batch
from ..ingest.validate import IngestError, TimeWindow
from ..storage.remote_write import RemoteWriter
from .api import (
    agent_node,
    ctx_of,
    error_response,
    float_param,
    handled,
    json_response,
    read_limited,
)

__all__ = ["MSGPACK_TYPES", "agent_routes"]

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

SERIES_WAIT_S = 5.0
"""With ``remote_write_url``, how long the ingest route waits for a batch's samples to be
in the series store before it answers 503 (the agent keeps the batch and sends it again):
half the agent's read timeout (10 s, :mod:`forewarn.agent.uplink`)."""

@handled
async def ingest(request: Request) -> Response:
    ctx = ctx_of(request)
    node = agent_node(ctx, request)
    ctype = _media_type(request)
    if ctype not in MSGPACK_TYPES:
        raise IngestError(415, "content_type",
                          f"Content-Type must be application/msgpack, got {ctype or 'none'!r}")
    body = await read_limited(request, ctx.config.max_body_bytes)
    received = ctx.clock()
    sent = request.headers.get(SENT_AT_HEADER)
    if sent is not None:
        ctx.metrics.clock_skew.labels(node).set(_sent_at(sent) - received)
    window = TimeWindow(received, ctx.config.ingest_max_age_s, ctx.config.ingest_max_future_s)
    address = request.client.host if request.client else ""
    checked, stored = accept_batch(ctx.writer, ctx.metrics, body, node=node, window=window,
                                   max_items=ctx.config.max_batch_items, address=address)
    batch = checked.batch
    result = await asyncio.wrap_future(stored)
    if ctx.series is not None and batch.samples:
        await _series_written(ctx.series, batch, result)
    answer: dict[str, Any] = {"result": result.value, "seq": batch.seq}
    if checked.refused:
        answer["refused"] = [r.as_json() for r in checked.refused]
    return json_response(answer)


def _media_type(request: Request) -> str:
    """The request's Content-Type without parameters, lower case ("" when absent)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _series_written(series: RemoteWriter, batch: AgentBatch, result: IngestResult
                          ) -> None:
    """Return once ``batch``'s GPU samples are in the series store (a duplicate's are
    queued again, :meth:`RemoteWriter.resend`), so the agent deletes a batch from its spool
    only then and a collector killed with samples queued loses none: the agent sends the
    batch again. Not written within :data:`SERIES_WAIT_S`: 503, the batch comes again."""
    if result is IngestResult.DUPLICATE:
        series.resend(batch.agent_id, batch.seq, batch.samples)
    written = asyncio.wrap_future(series.written())
    try:
        # shield: a timeout must not cancel the writer's future (its threads complete it)
        await asyncio.wait_for(asyncio.shield(written), SERIES_WAIT_S)
    except TimeoutError:
        raise IngestError(503, "series_store", "batch stored, but its samples are not in the"
                          f" series store after {SERIES_WAIT_S:g} s"
                          f" ({series.last_error or 'slow'}); send it again") from None
    except RuntimeError as exc:  # the writer stopped: this collector is shutting down
        raise IngestError(503, "series_store", f"{exc}; send it again") from None


def _sent_at(value: str) -> float:
    """The agent's clock when it sent the request (header :data:`SENT_AT_HEADER`)."""
    try:
        sent = float(value)
    except ValueError:
        sent = math.nan
    if not 0 < sent < MAX_UNIX_TIME:
        raise IngestError(400, "decode", f"{SENT_AT_HEADER}: expected Unix seconds, got "
                                         f"{value[:40]!r}")
    return sent


@handled
async def poll_commands(request: Request) -> Response:
    ctx = ctx_of(request)
    node = agent_node(ctx, request)
    wanted = request.query_params.get("node", node)
    if wanted != node:
        raise IngestError(403, "node_mismatch",
                          f"node: token is for node {node!r}, asked for {wanted!r}")
    wait = float_param(request, "wait") or 0.0
    wait = min(max(0.0, wait), ctx.config.long_poll_max_s)
    commands = await ctx.commands.poll(node, wait)
    return json_response(commands)


@handled
async def ack_command(request: Request) -> Response:
    ctx = ctx_of(request)
    node = agent_node(ctx, request)
    body = await read_limited(request, 64 * 1024)
    ctype = _media_type(request)
    try:
        ack = decode(body, CommandAck) if ctype in MSGPACK_TYPES else decode_json(body,
                                                                                  CommandAck)
    except WireError as exc:
        raise IngestError(400, "decode", str(exc)) from None
    if ack.id != request.path_params["id"]:
        raise IngestError(400, "decode", f"$.id: {ack.id!r} does not match the URL")
    if ack.node != node:
        raise IngestError(403, "node_mismatch",
                          f"$.node: token is for node {node!r}, ack says {ack.node!r}")
    state = await asyncio.to_thread(ctx.accept_ack, ack, node)
    if state == "unknown":
        return error_response(404, f"no command {ack.id!r} for node {node!r}")
    return json_response({"result": state})


def agent_routes() -> list[Route]:
    """The agents' three endpoints."""
    return [
        Route("/api/v1/ingest", ingest, methods=["POST"]),
        Route("/api/v1/commands", poll_commands, methods=["GET"]),
        Route("/api/v1/commands/{id}/ack", ack_command, methods=["POST"]),
    ]
