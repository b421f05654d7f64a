"""``forewarn dashboards``: generate the dashboard JSON, or push it to Grafana."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from forewarn.errors import UnavailableError

__all__ = ["PushError", "push", "register"]

REPO_DASHBOARDS = Path(__file__).resolve().parents[3] / "dashboards"


class PushError(UnavailableError, RuntimeError):
    """Grafana refused a request; the message says which and why."""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "dashboards",
        help="generate the Grafana dashboards, or push them to a Grafana instance",
        description="Grafana dashboards as code.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    gen = verbs.add_parser("generate", help="write dashboards/*.json from code",
                           description="Write every dashboard as JSON.")
    gen.add_argument("--out", type=Path, default=REPO_DASHBOARDS,
                     help="output folder (default: the repository's dashboards/)")
    gen.add_argument("--check", action="store_true",
                     help="write nothing; exit 1 if the files differ from the code")
    gen.set_defaults(func=_generate)
    push_p = verbs.add_parser("push", help="create or update the dashboards in Grafana",
                              description="Push every dashboard to Grafana over its HTTP API "
                              "(needs the 'grafana' extra: grafana-client).")
    push_p.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push_p.add_argument("--token", required=True,
                        help="service account token (or @FILE to read it from a file)")
    push_p.add_argument("--folder", default="forewarn", help="folder title (created if missing)")
    push_p.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    push_p.set_defaults(func=_push)


def _generate(args: argparse.Namespace) -> int:
    from forewarn.dashboards.build import DASHBOARDS, render

    out: Path = args.out
    stale = []
    for name in DASHBOARDS:
        path = out / f"{name}.json"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date (run `forewarn dashboards generate`): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


def push(url: str, token: str, folder: str = "forewarn", timeout: float = 10.0) -> list[str]:
    """Create ``folder`` if missing and upsert every dashboard into it; return their URLs.

    Raises :class:`PushError` naming the request and Grafana's message when it refuses.
    """
    from grafana_client.api import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException

    from forewarn.dashboards.build import DASHBOARDS

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout)
    try:
        folders = api.folder.get_all_folders()
        found = [f for f in folders if f.get("title") == folder]
        folder_uid = found[0]["uid"] if found else api.folder.create_folder(folder)["uid"]
    except (GrafanaClientError, GrafanaException) as exc:
        raise PushError(f"folder {folder!r}: {_message(exc)}") from None
    urls = []
    for name, build in DASHBOARDS.items():
        body = {"dashboard": build(), "folderUid": folder_uid, "overwrite": True,
                "message": "pushed by forewarn dashboards push"}
        try:
            result = api.dashboard.update_dashboard(body)
        except (GrafanaClientError, GrafanaException) as exc:
            raise PushError(f"dashboard {name!r}: {_message(exc)}") from None
        urls.append(str(result.get("url", "")))
    return urls


def _message(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    text = getattr(exc, "message", None) or str(exc)
    return f"HTTP {status}: {text}" if status else str(text)


def _push(args: argparse.Namespace) -> int:
    token: str = args.token
    if token.startswith("@"):
        token = Path(token[1:]).read_text().strip()
    try:
        urls = push(args.url, token, args.folder, args.timeout)
    except PushError as exc:
        print(f"forewarn dashboards push: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"forewarn dashboards push: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    for u in urls:
        print(json.dumps({"url": u}))
    return 0
