"""``forewarn status URL``: is an agent or a collector ready, and if not, why.

GETs ``URL/readyz`` (the agent's metrics address, default ``http://127.0.0.1:9403``, or the
collector's, ``http://127.0.0.1:9404``) and prints one line per component for a person, or
the JSON itself with ``--json``. Exit status: 0 ready, 1 not ready, 2 unreachable (or not
a forewarn service).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["format_report", "register"]

READY, NOT_READY, UNREACHABLE = 0, 1, 2


def register(sub: Any) -> None:
    """Add ``status`` to the ``forewarn`` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "status", help="is an agent or collector ready? (its /readyz, for a person)",
        description="Print an agent's or a collector's readiness per component. Exit "
                    "status: 0 ready, 1 not ready, 2 unreachable.")
    p.add_argument("url", nargs="?", default="http://127.0.0.1:9403",
                   help="base URL of the agent (default http://127.0.0.1:9403) or of the "
                        "collector (http://127.0.0.1:9404)")
    p.add_argument("--json", action="store_true", help="print the /readyz JSON as is")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    p.set_defaults(func=_run)


def format_report(report: dict[str, Any]) -> str:
    """The readiness report as lines for a person."""
    service = str(report.get("service", "service"))
    node = f" {report['node']}" if report.get("node") else ""
    lines = [f"{service}{node}: {'READY' if report.get('ready') else 'NOT READY'}"]
    for name, part in sorted(dict(report.get("components", {})).items()):
        extra = ", ".join(f"{k}={v}" for k, v in sorted(part.items())
                          if k not in ("ready", "detail"))
        mark = "ok " if part.get("ready") else "BAD"
        lines.append(f"  {mark} {name:<16} {part.get('detail', '')}"
                     + (f" ({extra})" if extra else ""))
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    import httpx

    url = args.url.rstrip("/") + "/readyz"
    try:
        r = httpx.get(url, timeout=args.timeout)
        report = r.json()
        if r.status_code not in (200, 503) or not isinstance(report, dict) \
                or "ready" not in report:
            raise ValueError(f"answered {r.status_code} without a readiness report")
    except (httpx.HTTPError, ValueError) as exc:
        print(f"forewarn status: {url} unreachable: {exc}", file=sys.stderr)
        return UNREACHABLE
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return READY if report["ready"] is True else NOT_READY
