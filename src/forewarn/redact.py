"""URLs in log lines without their secrets.

A Slack incoming-webhook URL carries its token in the path
(``https://hooks.slack.com/services/T…/B…/<token>``), a generic webhook or a remote-write
endpoint may carry one in the query or as ``user:password@``: a URL configured by an
operator is logged only as :func:`redact_url` gives it (scheme, host and port), and a
message that may quote it (an httpx error) only as :func:`scrub` leaves it.

httpx logs every request with its full URL (``HTTP Request: POST <url> "HTTP/1.1 200 OK"``,
INFO); :func:`redact_httpx_logs` installs a filter on the ``httpx`` logger that writes
those URLs redacted too.
"""

from __future__ import annotations

import logging
import urllib.parse

__all__ = ["redact_httpx_logs", "redact_url", "scrub"]


def redact_url(url: str) -> str:
    """``url`` as ``scheme://host[:port]``, plus ``/…`` when it had a path or a query:
    never its user info, path, query or fragment."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a port that is not a number: nothing of it is safe to show
        return "(unparsable URL)"
    if ":" in host:
        host = f"[{host}]"
    rest = "/…" if parts.path.strip("/") or parts.query or parts.fragment else ""
    return f"{parts.scheme or '?'}://{host}{port}{rest}"


def scrub(text: str, url: str) -> str:
    """``text`` with ``url`` and each of its secret-bearing parts (user info, path, query,
    fragment) replaced: for an exception message that may quote the URL, whole or cut up
    (httpx's ``repr(request)`` and its ``InvalidURL`` messages do)."""
    text = text.replace(url, redact_url(url))
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return text
    secrets = [parts.netloc.rpartition("@")[0], parts.query, parts.fragment]
    if parts.path.strip("/"):
        secrets.append(parts.path)
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "…")
    return text


class _HttpxUrls(logging.Filter):
    """Rewrites the URL arguments (``httpx.URL``) of an httpx log record redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                redact_url(str(a)) if type(a).__name__ == "URL" else a for a in record.args
            )
        return True


def redact_httpx_logs() -> None:
    """Make the ``httpx`` logger write URLs redacted (idempotent; process-wide, as the
    logger is)."""
    logger = logging.getLogger("httpx")
    if not any(isinstance(f, _HttpxUrls) for f in logger.filters):
        logger.addFilter(_HttpxUrls())
