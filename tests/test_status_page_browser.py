"""The collector's built-in status page in a real browser (Playwright, system Chromium,
headless) while a fault is injected: a real collector fed by a real ``forewarn agent
--source sim`` whose GPUs fail within seconds, and a toy job with one rank per GPU
(``local_rank`` = GPU index). The page, opened before the faults land, must show the
unhealthy GPU and the collector's checkpoint order for the job without a reload; a
screenshot is saved and checked for size.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from forewarn.wire import Finding, GpuSample, Health, RankSummary, Subject

from support.collector import start_service, stop_service
from support.hostile import HOSTILE
from support.stack import JOB, NODE, running_stack

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


@pytest.mark.timeout(180)
def test_status_page_shows_unhealthy_gpu_and_checkpoint_order(
    tmp_path: Path, require_binary: Callable[[str], str]
) -> None:
    chromium = require_binary("chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    shot = tmp_path / "status-page.png"
    node, job = NODE, JOB
    # Three healthy ranks on GPUs 0..2; GPU 1's ECC storm ends in a double-bit error, GPU 2
    # runs hot: the collector's policy orders the job to checkpoint.
    with running_stack(tmp_path, ranks=3, nan_rank=None, hang_rank=None) as stack, \
            sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(stack.collector_url + "/")
            assert page.title().startswith("forewarn")

            # The grid fills in from the agent's first batches, before the faults land.
            grid = page.locator(f'#fleet [data-node="{node}"] .cell')
            grid.nth(5).wait_for(timeout=30_000)
            assert grid.count() == 6
            assert page.locator(f'#fleet [data-node="{node}"] .sim-badge').count() == 1

            # The fault: without a reload, the GPU turns unhealthy ...
            bad = page.locator(f'#fleet [data-node="{node}"] .cell[data-health="unhealthy"]')
            bad.first.wait_for(timeout=60_000)
            unhealthy = {bad.nth(i).get_attribute("data-gpu") for i in range(bad.count())}
            assert unhealthy & {"1", "2", "3", "4", "5"}, unhealthy
            assert page.locator('#fleet .cell[data-gpu="0"]').get_attribute(
                "data-health") == "healthy"
            # GPU 1's double-bit error (XID 48) keeps it unhealthy, as the agent judges it,
            # even when a later finding of another check (a pending remap) is only degraded.
            page.locator('#fleet .cell[data-gpu="1"][data-health="unhealthy"]').wait_for(
                timeout=30_000)

            # ... and the collector's checkpoint order for the job on it shows up.
            order = page.locator("#orders tbody tr[data-order]").filter(has_text=job)
            order.first.wait_for(timeout=60_000)
            cells = order.first.locator("td").all_inner_texts()
            assert cells[1] == node and cells[2] == job, cells
            assert int(cells[3]) > 0, cells  # the step S every rank saves at
            # the reason: the finding on GPU 1 (ECC storm, DBE) or GPU 2 (thermal)
            assert re.search(r"XID (48|92)|ECC|thermal|slowdown", cells[4]), cells

            # The job's ranks, and the live findings naming the GPU.
            page.locator(f'#jobs tr[data-job="{job}"]').wait_for(timeout=30_000)
            assert "3 / 3" in page.locator(f'#jobs tr[data-job="{job}"]').inner_text()
            assert page.locator("#findings tbody tr").filter(
                has_text=f"gpu:{node}/").count() >= 1
            # live findings are the problems: no "all fine" row pushes them off the table
            assert page.locator("#findings .badge.healthy").count() == 0
            assert page.locator("#findings .badge.unhealthy").count() >= 1
            assert "unhealthy" in page.locator("#summary").inner_text()
            assert not errors, errors

            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
        finally:
            browser.close()

    data = shot.read_bytes()
    width, height = png_size(data)
    assert len(data) > 20_000, len(data)
    assert width == 1400 and height >= 1000, (width, height)


@pytest.mark.timeout(120)
def test_status_page_renders_hostile_job_names_as_text(
    tmp_path: Path, require_binary: Callable[[str], str]
) -> None:
    """Job names with "/", quotes, markup, newlines, non-BMP characters and the longest
    name the wire allows, plus a long reason with markup: each job gets its row, shown as
    text (no script runs), and the page keeps refreshing and stays within its width."""
    chromium = require_binary("chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    svc = start_service(tmp_path)
    try:
        now = time.time()
        ranks = [RankSummary(job=job, rank=0, node="node1", gpu=0, pid=100 + i, last_step=10,
                             last_step_time=now) for i, job in enumerate(HOSTILE)]
        reason = ("<script>window.__xss=1</script> \"quoted\" " * 200)[:4096]
        finding = Finding(check="xid", health=Health.UNHEALTHY, reason=reason, time=now,
                          subject=Subject(kind="gpu", node="node1", gpu=0))
        svc.push("node1", ranks=ranks, findings=[finding], samples=[
            GpuSample(node="node1", gpu=0, time=now, source="sim", simulated=True)])
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(svc.server.url + "/")
                page.locator("#jobs tbody tr[data-job]").nth(len(HOSTILE) - 1).wait_for(
                    timeout=30_000)
                shown = page.eval_on_selector_all(
                    "#jobs tbody tr[data-job]",
                    "rows => rows.map(r => [r.dataset.job, r.cells[0].textContent,"
                    " r.cells[1].textContent])")
                assert sorted(s[0] for s in shown) == sorted(HOSTILE)
                assert all(s[0] == s[1] for s in shown), shown
                ranks_of = {s[0]: s[2] for s in shown}
                assert ranks_of["team/a/run-1"].startswith("1 / "), ranks_of  # detail loaded
                page.locator("#findings tbody td.reason").first.wait_for(timeout=10_000)
                assert "<script>" in page.locator("#findings td.reason").first.inner_text()
                assert page.evaluate("window.__xss") is None
                assert page.locator("#updated").inner_text().startswith("updated")
                width = page.evaluate("document.documentElement.scrollWidth")
                assert width <= 1400, width
                assert not errors, errors
            finally:
                browser.close()
    finally:
        stop_service(svc)
