"""``GET /readyz``: is the collector able to do its work, component by component.

``/healthz`` is liveness (the process answers and its database opens: restart it when
not); ``/readyz`` is readiness: JSON ``{"ready": bool, "service": "collector",
"components": {name: {"ready": bool, "detail": str, ...}}}``, status 503 when any
component is not ready:

* ``storage``: a small file can be written and fsync'd in ``data_dir`` (disk full,
  read-only or missing directory) and the database answers (not ready while ingest
  retries its commits because the state store was unavailable, e.g. PostgreSQL
  restarting: ``detail`` names the error);
* ``ingest``: the group-commit writer thread runs (with its queue length);
* ``leader``: whether this replica runs the policy (always ready: a follower serves
  ingest, reads and long polls; see :mod:`~forewarn.collector.storage.leader`);
* ``remote_write``: the series queue and the last error (always ready: samples wait in
  a bounded queue or are dropped and counted, ingest never waits for the series store);
* ``telemetry_flush``: the last staging-to-Parquet flush worked (its error otherwise,
  with the samples still staged);
* ``bus`` (only with ``bus_url``): connected to a NATS server and its last pull, store
  or publish worked (:meth:`~forewarn.collector.ingest.bus.BusConsumer.readiness`);
* the policy's own components (a policy with a ``readiness()`` method,
  :class:`ReadinessHook`): ``predictor``, not ready while the shipped failure model still
  loads in the background after start-up, or when it could not be loaded
  (:meth:`~forewarn.collector.decide.predict.PredictorService.readiness`); its detail names
  the model that runs (``model registry v3``), which follows the model registry without a
  restart (the running model stays, and ready, while a newer version loads).

``forewarn status URL`` prints it for a person.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from starlette.requests import Request
from starlette.responses import Response

from ..storage.remote_write import status as remote_write_status
from .api import ctx_of, json_response

if TYPE_CHECKING:
    from .context import CollectorContext

__all__ = ["ReadinessHook", "collector_readiness", "readyz"]

PROBE = ".readyz-probe"


@runtime_checkable
class ReadinessHook(Protocol):
    """A policy with ``/readyz`` components of its own (called from any thread)."""

    def readiness(self) -> dict[str, dict[str, Any]]:
        """Component name -> ``{"ready": bool, "detail": str, ...}``."""


def _storage(ctx: CollectorContext) -> dict[str, Any]:
    path = ctx.config.data_dir / PROBE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        ctx.store.scalar("SELECT 1")
    except Exception as exc:  # any failure is the answer, never a 500
        return {"ready": False, "detail": f"{ctx.config.data_dir}, {ctx.store.location}: {exc}"}
    if ctx.writer.store_error:  # answered again, but the last commit attempt failed
        return {"ready": False, "detail": f"{ctx.store.location}: commits retried after "
                                          f"{ctx.writer.store_error}"}
    return {"ready": True, "detail": f"{ctx.config.data_dir} writable, state at "
                                     f"{ctx.store.location}"}


def collector_readiness(ctx: CollectorContext) -> dict[str, Any]:
    """The ``/readyz`` report (blocking: the storage probe writes a file)."""
    alive = ctx.writer.alive
    flush_error = ctx.flush_error
    try:
        staged: int | None = ctx.telemetry.staged_samples()
    except Exception:  # the storage part says why
        staged = None
    parts = {
        "storage": _storage(ctx),
        "ingest": {"ready": alive, "queued": ctx.writer.queued,
                   "detail": "writer thread running" if alive else "writer thread stopped"},
        "leader": {"ready": True, **ctx.leader.status()},
        "remote_write": remote_write_status(ctx.series),
        "telemetry_flush": {
            "ready": not flush_error, "staged_samples": staged, "last_flush": ctx.flush_time,
            "detail": flush_error or ("last flush ok" if ctx.flush_time else "no flush yet")},
    }
    if ctx.bus is not None:
        parts["bus"] = ctx.bus.readiness()
    if isinstance(ctx.policy, ReadinessHook):
        parts.update(ctx.policy.readiness())
    return {"ready": all(p["ready"] for p in parts.values()), "service": "collector",
            "components": parts}


async def readyz(request: Request) -> Response:
    report = await asyncio.to_thread(collector_readiness, ctx_of(request))
    return json_response(report, 200 if report["ready"] else 503)
