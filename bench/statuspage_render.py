"""First render of the status page for a large fleet, in headless Chromium.

A real collector (uvicorn on loopback, SQLite) is filled through its ingest API with a
simulated fleet (``tests/support/fleet.py``: ``--nodes`` nodes of ``--gpus`` GPUs, ``--jobs``
jobs, a few sick GPUs and one GPU repeating an XID). Each run opens the page in a fresh
browser context (nothing cached) and reads the page's own User Timing marks, in
milliseconds from the start of navigation: ``first-render``, the grid, the jobs table and
the event tables drawn from the read API's first answers, and ``full-render``, the jobs'
risk and goodput columns filled in too (answered by the policy thread). The page's height
is printed too.

    python bench/statuspage_render.py --nodes 1000 --jobs 200 --runs 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.fleet import Fleet, start_fleet_collector

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--screenshot", type=Path, help="save the last run's full page here")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    fleet = Fleet(nodes=args.nodes, gpus=args.gpus, jobs=args.jobs)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fw-page-") as tmp:
        server, store, client = start_fleet_collector(Path(tmp), fleet)
        try:
            print(f"filled {args.nodes} nodes x {args.gpus} GPUs, {args.jobs} jobs through "
                  f"the ingest API in {time.monotonic() - t0:.1f} s")
            sizes = {p: len(client.get(f"/api/v1/{p}").content)
                     for p in ("gpus?limit=100000", "jobs", "findings?limit=200")}
            print("answer sizes (bytes): " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))
            first: list[float] = []
            full: list[float] = []
            heights: list[int] = []
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
                for _ in range(args.runs):
                    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
                    page = ctx.new_page()
                    page.goto(server.url + "/")
                    page.wait_for_function(
                        "() => performance.getEntriesByName('full-render').length > 0",
                        timeout=60_000)
                    first.append(page.evaluate(
                        "performance.getEntriesByName('first-render')[0].startTime"))
                    full.append(page.evaluate(
                        "performance.getEntriesByName('full-render')[0].startTime"))
                    heights.append(page.evaluate("document.documentElement.scrollHeight"))
                    if args.screenshot is not None:
                        page.screenshot(path=str(args.screenshot), full_page=True)
                    ctx.close()
                browser.close()
        finally:
            client.close()
            server.stop()
            store.close()
    for name, values in (("first render", first), ("full render", full)):
        print(f"{name} over {args.runs} runs: median {statistics.median(values):.0f} ms, "
              f"min {min(values):.0f} ms, max {max(values):.0f} ms")
    print(f"page height {max(heights)} px at 1400 x 1000")


if __name__ == "__main__":
    main()
