"""Order latency under an alert storm: from a fatal finding posted by an agent to every node
of the job holding the checkpoint order, while ``--rate`` alerts per second arrive at
``POST /api/v1/alerts/alertmanager`` over real HTTP.

Same set-up as ``bench/order_latency.py`` (a real ``forewarn collector`` process pinned to
core 0, simulated agents holding long polls, policy gates open), plus an alert token. First
``--trials`` trials without alerts (the unloaded figure), then the storm starts and the
same number of trials run during it. The storm posts Alertmanager bodies of ``--per-post``
alerts, paced to ``--rate`` alerts/s (at most 64 requests in flight), drawn in turn from
``--distinct`` label sets (20 alert names x GPUs of nodes that host none of the jobs), so
for the first ``distinct / rate`` seconds every alert is new and later ones are re-sends,
as Alertmanager's group and repeat intervals produce. Reported: p50/p99/max of both phases,
the alert rate actually accepted, webhook answer p99, and the size of the database.

    python bench/alert_storm.py --nodes 16 --job-nodes 4 --trials 100 --rate 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from order_latency import Fleet, collector_process, summary

ALERT_TOKEN = "bench-alert-token-0123456789"


def payload(start: int, n: int, distinct: int) -> dict[str, Any]:
    alerts = []
    for i in range(start, start + n):
        k = i % distinct
        alerts.append({"status": "firing", "annotations": {"summary": "storm"},
                       "labels": {"alertname": f"Storm{k % 20}", "node": f"storm{k // 160}",
                                  "gpu": str(k // 20 % 8), "severity": "warning"},
                       "startsAt": "2026-01-01T00:00:00Z"})
    return {"version": "4", "status": "firing", "receiver": "forewarn", "groupLabels": {},
            "commonLabels": {}, "alerts": alerts}


class Storm:
    """Paced alert posts until stopped; counts what was accepted and how long each took."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(
            max_connections=64), headers={"authorization": f"Bearer {ALERT_TOKEN}"})
        self.args = args
        self.accepted = 0
        self.failed = 0
        self.answer_s: list[float] = []
        self.started = 0.0
        self.ended = 0.0
        self._stop = asyncio.Event()
        self._slots = asyncio.Semaphore(64)
        self._tasks: set[asyncio.Task[None]] = set()

    async def _post(self, start: int) -> None:
        try:
            t0 = time.perf_counter()
            r = await self.client.post("/api/v1/alerts/alertmanager", json=payload(
                start, self.args.per_post, self.args.distinct))
            self.answer_s.append(time.perf_counter() - t0)
            if r.status_code == 200:
                self.accepted += self.args.per_post
            else:
                self.failed += self.args.per_post
        except httpx.HTTPError:
            self.failed += self.args.per_post
        finally:
            self._slots.release()

    async def run(self) -> None:
        interval = self.args.per_post / self.args.rate
        self.started = time.perf_counter()
        sent = 0
        while not self._stop.is_set():
            await self._slots.acquire()
            task = asyncio.create_task(self._post(sent))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            sent += self.args.per_post
            delay = self.started + (sent / self.args.per_post) * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ended = time.perf_counter()
        await self.client.aclose()

    def stop(self) -> None:
        self._stop.set()


async def drive(url: str, tokens: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    fleet = Fleet(url, tokens, args.job_nodes)
    await fleet.start()
    unloaded = await fleet.trials(0, args.trials, args.gap)
    storm = Storm(url, args)
    storm_task = asyncio.create_task(storm.run())
    await asyncio.sleep(args.warmup)
    loaded = await fleet.trials(args.trials, args.trials, args.gap)
    storm.stop()
    await storm_task
    await fleet.close()
    answers = sorted(storm.answer_s)
    return {
        "nodes": len(tokens), "job_nodes": args.job_nodes,
        "unloaded": summary(unloaded),
        "storm": summary(loaded),
        "alerts_offered_per_s": args.rate,
        "alerts_accepted_per_s": round(storm.accepted / (storm.ended - storm.started)),
        "alerts_accepted": storm.accepted, "alerts_failed": storm.failed,
        "webhook_answer_p99_ms": 1000 * answers[min(len(answers) - 1,
                                                    int(0.99 * len(answers)))],
    }


def database(data: Path) -> dict[str, Any]:
    """Size of the collector's database (with its WAL) and its alert-related rows."""
    size = sum(p.stat().st_size for p in data.glob("collector.db*"))
    with contextlib.closing(sqlite3.connect(f"file:{data / 'collector.db'}?mode=ro",
                                            uri=True, timeout=30)) as db:
        def count(sql: str) -> int:
            try:
                return int(db.execute(sql).fetchone()[0])
            except sqlite3.OperationalError:  # no such table (before the alert book)
                return -1

        return {"db_mib": round(size / 2**20, 1),
                "alert_rows": count("SELECT count(*) FROM alerts"),
                "alert_findings": count(
                    "SELECT count(*) FROM findings WHERE check_name LIKE 'alert:%'"),
                "decisions": count("SELECT count(*) FROM decisions")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--job-nodes", type=int, default=4)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--gap", type=float, default=0.1, help="seconds between trials")
    ap.add_argument("--rate", type=float, default=1000.0, help="alerts per second")
    ap.add_argument("--per-post", type=int, default=20, help="alerts per webhook request")
    ap.add_argument("--distinct", type=int, default=8000, help="distinct alert label sets")
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of storm before the loaded trials")
    args = ap.parse_args()
    with collector_process(args.nodes, f'alert_token = "{ALERT_TOKEN}"\n') as (url, tokens,
                                                                                data):
        result = asyncio.run(drive(url, tokens, args))
        time.sleep(2)  # the last alert rows and findings are flushed
        result |= database(data)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
