"""The built-in status page: ``GET /`` and its assets, shipped in the package (no build
step, no CDN: clusters often reach nothing outside). The page polls the read API."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

__all__ = ["STATIC", "routes"]

STATIC = Path(__file__).resolve().parent / "static"


async def _index(request: Request) -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def routes() -> list[BaseRoute]:
    """``/`` (the page) and ``/static/*`` (its script and style)."""
    return [
        Route("/", _index, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
