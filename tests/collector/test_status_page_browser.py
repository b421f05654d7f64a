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
from typing import Any

import pytest

from forewarn.wire import (
    CheckpointReport,
    Finding,
    GpuSample,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
)

from support.browser import CHROMIUM_ARGS, chromium_page
from support.collector import ranks_on, start_service, stop_service
from support.fleet import Fleet, node_name, start_fleet_collector
from support.hostile import AWKWARD
from support.polling import wait_for
from support.stack import JOB, NODE, running_stack


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
            # Incidents: one row per incident with its findings inside. GPU 1's double-bit
            # error (its XID 48 and its uncorrectable-ECC finding) is one row, not two.
            gpu1 = page.locator(f'#incidents tbody tr[data-scope="gpu:{node}/1"]')
            gpu1.locator('.finding[data-check="xid"]').wait_for(timeout=30_000)
            gpu1.locator('.finding[data-check="ecc"]').wait_for(timeout=30_000)
            assert gpu1.count() == 1
            scopes = page.eval_on_selector_all(
                "#incidents tbody tr[data-scope]", "rows => rows.map(r => r.dataset.scope)")
            assert len(scopes) == len(set(scopes)), scopes
            assert page.locator("#incidents .badge.unhealthy").count() >= 1
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
    """Job names with "/", "..", "%2F", quotes, markup, newlines, non-BMP characters and the
    longest name the wire allows, plus a long reason with markup: each job gets its row and
    its detail (fetched by name), shown as text (no script runs), and the page keeps
    refreshing and stays within its width."""
    chromium = require_binary("chromium")
    svc = start_service(tmp_path)
    try:
        now = time.time()
        ranks = [RankSummary(job=job, rank=0, node="node1", gpu=0, pid=100 + i, last_step=i,
                             last_step_time=now) for i, job in enumerate(AWKWARD)]
        reason = ("<script>window.__xss=1</script> \"quoted\" " * 200)[:4096]
        finding = Finding(check="xid", health=Health.UNHEALTHY, reason=reason, time=now,
                          subject=Subject(kind="gpu", node="node1", gpu=0))
        svc.push("node1", ranks=ranks, findings=[finding], samples=[
            GpuSample(node="node1", gpu=0, time=now, source="sim", simulated=True)])
        with chromium_page(chromium, svc.server.url + "/") as (page, errors):
            page.locator("#jobs tbody tr[data-job]").nth(len(AWKWARD) - 1).wait_for(
                timeout=30_000)
            shown = page.eval_on_selector_all(
                "#jobs tbody tr[data-job]",
                "rows => rows.map(r => [r.dataset.job, r.cells[0].textContent,"
                " r.cells[1].textContent])")
            assert sorted(s[0] for s in shown) == sorted(AWKWARD)
            assert all(s[0] == s[1] for s in shown), shown
            # every job's detail comes by name, whatever the name
            for i in range(len(AWKWARD)):
                row = page.locator("#jobs tbody tr[data-job]").nth(i)
                name = row.get_attribute("data-job")
                row.locator("button.job-name").click()
                page.wait_for_function(
                    "name => { const d = document.getElementById('job-detail');"
                    " return d.dataset.job === name && d.dataset.loaded === 'yes'; }",
                    arg=name, timeout=10_000)
                detail = page.locator("#job-detail")
                assert detail.locator(".job-title").text_content() == name
                rows = detail.locator("tbody tr").all_inner_texts()
                assert len(rows) == 1 and "node1" in rows[0], (name, rows)
                step = AWKWARD.index(name or "")
                assert f"· step {step} ·" in detail.locator(".job-summary").inner_text()
            page.locator("#findings tbody td.reason").first.wait_for(timeout=10_000)
            assert "<script>" in page.locator("#findings td.reason").first.inner_text()
            page.locator("#incidents tbody .reason").first.wait_for(timeout=10_000)
            assert "<script>" in page.locator("#incidents .reason").first.inner_text()
            assert page.evaluate("window.__xss") is None
            assert page.locator("#updated").inner_text().startswith("updated")
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 1400, width
            assert not errors, errors
    finally:
        stop_service(svc)


def red_gpus(svc: Any, node: str, gpus: int, repeats: int, now: float) -> None:
    """``node``'s GPUs 0..gpus-1: fine 100 s ago, then ``repeats`` XID 48 findings in turn
    across them (newest last)."""
    samples = [GpuSample(node=node, gpu=g, time=now, source="dcgm") for g in range(gpus)]
    fine = [Finding(check="xid", health=Health.HEALTHY, reason="no XID", time=now - 100,
                    subject=Subject(kind="gpu", node=node, gpu=g)) for g in range(gpus)]
    red = [Finding(check="xid", health=Health.UNHEALTHY, time=now - k * 0.1,
                   reason=f"XID 48: double-bit ECC error (event {k})",
                   subject=Subject(kind="gpu", node=node, gpu=k % gpus))
           for k in range(repeats, 0, -1)]
    svc.push(node, samples=samples, findings=fine)
    svc.push(node, findings=red)


@pytest.mark.timeout(120)
def test_status_page_job_state_and_risk(
    tmp_path: Path, require_binary: Callable[[str], str]
) -> None:
    """A job whose GPUs are all red never shows a green risk, whatever the model says; a
    job whose ranks ended cleanly is finished (no rank shown gone, no risk)."""
    chromium = require_binary("chromium")
    svc = start_service(tmp_path)
    try:
        now = time.time()
        red_gpus(svc, "node1", 4, 4, now)
        red_gpus(svc, "node2", 4, 0, now)
        red = [RankSummary(job="all-red", rank=g, world_size=4, node="node1", gpu=g,
                           pid=100 + g, last_step=900, last_step_time=now) for g in range(4)]
        done = [RankSummary(job="done", rank=g, world_size=4, node="node2", gpu=g, pid=200 + g,
                            last_step=500, last_step_time=now - 5, last_beat=now - 4,
                            alive=False, finished=True) for g in range(4)]
        svc.push("node1", ranks=red)
        svc.push("node2", ranks=done)
        with chromium_page(chromium, svc.server.url + "/") as (page, errors):
            red_row = page.locator('#jobs tr[data-job="all-red"]')
            red_row.wait_for(timeout=30_000)
            risk = red_row.locator("td.risk .badge")
            risk.wait_for(timeout=30_000)
            assert "unhealthy" in (risk.get_attribute("class") or ""), risk.inner_html()
            assert "unhealthy" in risk.inner_text(), risk.inner_text()

            done_row = page.locator('#jobs tr[data-job="done"]')
            assert done_row.locator("td.state").inner_text() == "finished"
            assert "gone" not in done_row.inner_text(), done_row.inner_text()
            assert done_row.locator("td.risk").inner_text() == "—"
            done_row.locator("button.job-name").click()
            page.locator('#job-detail[data-loaded="yes"]').wait_for(timeout=10_000)
            states = page.locator("#job-detail tbody td.rank-state").all_inner_texts()
            assert states == ["finished"] * 4, states
            assert not errors, errors
    finally:
        stop_service(svc)


@pytest.mark.timeout(120)
def test_status_page_collapses_repeated_findings(
    tmp_path: Path, require_binary: Callable[[str], str]
) -> None:
    """300 repeats of the same XID on four GPUs are four rows with their counts (of the
    findings the page reads), and the page stays short."""
    chromium = require_binary("chromium")
    svc = start_service(tmp_path)
    try:
        red_gpus(svc, "node1", 4, 300, time.time())
        with chromium_page(chromium, svc.server.url + "/") as (page, errors):
            page.locator("#findings tbody .badge.unhealthy").first.wait_for(timeout=30_000)
            rows = page.locator("#findings tbody tr")
            texts = rows.all_inner_texts()
            assert rows.count() == 4, texts  # one row per GPU and check, not 300
            for g in range(4):
                mine = [t for t in texts if f"gpu:node1/{g}" in t]
                # the page reads the newest 200 findings: 50 repeats per GPU there
                assert len(mine) == 1 and "×50" in mine[0], (g, texts)
            height = page.evaluate("document.documentElement.scrollHeight")
            assert height <= 2500, height
            assert not errors, errors
    finally:
        stop_service(svc)


@pytest.mark.timeout(400)
def test_status_page_with_1000_nodes_and_200_jobs(
    tmp_path: Path, require_binary: Callable[[str], str]
) -> None:
    """A fleet of 1,000 nodes (8,000 GPUs) and 200 jobs, pushed through the ingest API:
    every node and every job can be reached on the page (paging, search, a problems-only
    filter), the page height stays bounded, and a screenshot is saved."""
    chromium = require_binary("chromium")
    fleet = Fleet()
    server, store, client = start_fleet_collector(tmp_path, fleet)
    shot = tmp_path / "status-page-fleet.png"
    nodes = {node_name(i) for i in range(fleet.nodes)}
    sick = {node_name(i) for i in range(fleet.nodes) if fleet.sick(i)} | {node_name(0)}
    try:
        with chromium_page(chromium, server.url + "/") as (page, errors):
            page.wait_for_function(
                "() => document.getElementById('summary').textContent"
                ".startsWith('8000 GPUs')", timeout=60_000)
            height = page.evaluate("document.documentElement.scrollHeight")
            assert height <= 3000, height

            def every(what: str, item: str, attr: str) -> list[str]:
                seen: list[str] = []
                while True:
                    seen += [page.locator(item).nth(i).get_attribute(attr) or ""
                             for i in range(page.locator(item).count())]
                    nxt = page.locator(f"#{what}-pager button.next")
                    if nxt.is_disabled():
                        return seen
                    before = page.locator(f"#{what}-pager .info").inner_text()
                    nxt.click()
                    page.wait_for_function(
                        "([id, before]) => document.querySelector(id).textContent"
                        " !== before", arg=[f"#{what}-pager .info", before])

            shown = every("fleet", "#fleet .node", "data-node")
            assert len(shown) == len(nodes) and set(shown) == nodes
            jobs = every("jobs", "#jobs tbody tr[data-job]", "data-job")
            assert sorted(jobs) == [f"job-{j:03d}" for j in range(fleet.jobs)]
            # the worst come first: the first page of the grid starts with the sick nodes
            page.locator("#fleet-pager button.first").click()
            first = page.locator("#fleet .node").first.get_attribute("data-node")
            assert first in sick, first

            page.fill("#fleet-search", "gpu-node-0737")
            page.wait_for_function(
                "() => document.querySelectorAll('#fleet .node').length === 1")
            cells = page.locator('#fleet .node[data-node="gpu-node-0737"] .cell')
            assert cells.count() == fleet.gpus
            page.fill("#fleet-search", "")
            page.check("#fleet-problems")
            page.wait_for_function(
                "n => document.querySelectorAll('#fleet .node').length === n",
                arg=len(sick))
            assert set(page.eval_on_selector_all(
                "#fleet .node", "ns => ns.map(n => n.dataset.node)")) == sick
            page.uncheck("#fleet-problems")

            page.fill("#jobs-search", "job-137")
            page.wait_for_function(
                "() => document.querySelectorAll('#jobs tbody tr[data-job]').length === 1")
            assert page.locator('#jobs tr[data-job="job-137"]').count() == 1
            page.fill("#jobs-search", "")

            height = page.evaluate("document.documentElement.scrollHeight")
            assert height <= 3000, height
            assert not errors, errors
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
    finally:
        client.close()
        server.stop()
        store.close()
    width, shot_height = png_size(shot.read_bytes())
    assert width == 1400 and 1000 <= shot_height <= 3000, (width, shot_height)


@pytest.mark.timeout(120)
def test_status_page_shows_the_last_good_step_and_suspect_checkpoints(
    tmp_path: Path, require_binary: Callable[[str], str]
) -> None:
    """A job whose loss turned NaN at step 480 (the policy holds its saves): its detail on
    the page names the onset and the last good checkpoint to restart from (step 400), and
    lists its checkpoints with those saved since the onset marked suspect."""
    chromium = require_binary("chromium")
    svc = start_service(tmp_path)
    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        svc.push("node2", ranks=ranks_on("node2", 2, now))
        saves = [CheckpointReport(job="train-1", rank=rank, host=node, request_id="",
                                  step=step, phase="done", seconds=3.0, bytes=1 << 20,
                                  time=now - 100 + step / 10, path=f"/ck/step-{step}")
                 for step in (400, 490, 520) for rank, node in ((0, "node1"), (2, "node2"))]
        svc.push("node1", checkpoints=[c for c in saves if c.rank == 0])
        svc.push("node2", checkpoints=[c for c in saves if c.rank == 2])
        svc.push("node1", findings=[Finding(
            check="nan_loss", health=Health.UNHEALTHY, action=SuggestedAction.RESTART_JOB,
            subject=Subject(kind="rank", node="node1", gpu=1, job="train-1", rank=1),
            reason="rank 1 of job train-1: NaN loss since step 480",
            evidence={"bad_step": 480, "step": 483}, time=now)])
        wait_for(lambda: svc.client.get("/api/v1/jobs/train-1").json()["numerics"], 10,
                 "the policy's hold")
        with chromium_page(chromium, svc.server.url + "/") as (page, errors):
            row = page.locator('#jobs tr[data-job="train-1"]')
            row.wait_for(timeout=30_000)
            row.locator("button.job-name").click()
            page.locator('#job-detail[data-loaded="yes"]').wait_for(timeout=10_000)
            summary = page.locator("#job-detail .job-summary").inner_text()
            assert "suspect since step 480" in summary, summary
            assert "last good checkpoint: step 400" in summary, summary
            ckpts = page.locator("#job-detail .checkpoints tbody tr[data-step]")
            ckpts.first.wait_for(timeout=10_000)
            shown = {ckpts.nth(i).get_attribute("data-step"):
                     ckpts.nth(i).get_attribute("data-suspect") for i in range(ckpts.count())}
            assert shown == {"520": "yes", "490": "yes", "400": "no"}, shown
            good = page.locator('#job-detail .checkpoints tr[data-step="400"]').inner_text()
            assert "last good" in good and "suspect" not in good, good
            bad = page.locator('#job-detail .checkpoints tr[data-step="490"]').inner_text()
            assert "suspect" in bad and "2 ranks" in bad, bad
            assert not errors, errors
    finally:
        stop_service(svc)
