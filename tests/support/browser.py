"""A headless Chromium page (Playwright, the system's Chromium) for tests of the status page."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def chromium_page(chromium: str, url: str) -> Iterator[tuple[Any, list[str]]]:
    """A headless Chromium page (1400 x 1000) on ``url``, and the page errors it collects."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()
