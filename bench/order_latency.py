"""Order latency: from a finding posted by an agent to every node of the job holding the
checkpoint order, through the real ``forewarn collector`` process.

One collector process (pinned to core 0 when ``taskset`` exists) with the real policy
(cost model, dedup/cooldown/rate limits/breaker set open, and each trial's GPU recovers after
it so the next trial is a new incident: every trial acts), real HTTP on
loopback. ``--nodes`` simulated agents each hold the command long poll open
(``GET /api/v1/commands?wait=25``) and acknowledge what they get, as the agent uplink does.
Jobs span ``--job-nodes`` nodes each. Each trial: the agent of one node of a job posts an
urgent batch with an unhealthy ``gpu_lost`` finding on a GPU of the job; the latency is the
time until the last node of that job has received the order.

Measured here: the collector leg (ingest -> policy -> command queue -> long polls). The
agent -> hook leg is a local datagram (``bench/hook_step.py``, agent fast path).

    python bench/order_latency.py --nodes 64 --job-nodes 8 --trials 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec

from forewarn.collector.http.auth import hash_token
from forewarn.wire import (
    AgentBatch,
    Command,
    Finding,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
    encode,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    """One simulated node: batches with its ranks and findings, the command long poll."""

    def __init__(self, url: str, node: str, token: str) -> None:
        self.node = node
        self.client = httpx.AsyncClient(base_url=url, timeout=60,
                                         headers={"authorization": f"Bearer {token}"})
        self.seq = 0
        self.received: dict[str, float] = {}
        self.waiters: list[tuple[str, asyncio.Future[float]]] = []

    async def post(self, **kw: object) -> None:
        b = AgentBatch(node=self.node, agent_id=f"bench-{self.node}", seq=self.seq,
                       created=time.time(), **kw)  # type: ignore[arg-type]
        self.seq += 1
        r = await self.client.post("/api/v1/ingest", content=encode(b),
                                   headers={"content-type": "application/msgpack"})
        r.raise_for_status()

    async def poll(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                r = await self.client.get("/api/v1/commands",
                                          params={"node": self.node, "wait": 25})
            except httpx.HTTPError:
                if stop.is_set():
                    return
                raise
            now = time.perf_counter()
            for c in msgspec.json.decode(r.content, type=list[Command]):
                if c.order is None:
                    continue
                self.received[c.order.job] = now
                for job, fut in list(self.waiters):
                    if job == c.order.job and not fut.done():
                        fut.set_result(now)
                ack = {"id": c.id, "node": self.node, "ok": True, "time": time.time()}
                await self.client.post(f"/api/v1/commands/{c.id}/ack", json=ack)

    def wait_order(self, job: str) -> asyncio.Future[float]:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiters.append((job, fut))
        return fut


class Fleet:
    """Simulated agents with jobs spanning ``job_nodes`` nodes each, holding long polls."""

    def __init__(self, url: str, tokens: dict[str, str], job_nodes: int) -> None:
        self.agents = {n: Agent(url, n, t) for n, t in tokens.items()}
        nodes = sorted(self.agents)
        self.jobs = {f"job{j}": nodes[j * job_nodes:(j + 1) * job_nodes]
                     for j in range(len(nodes) // job_nodes)}
        self._stop = asyncio.Event()
        self._polls: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        now = time.time()
        for job, members in self.jobs.items():
            for i, node in enumerate(members):
                ranks = [RankSummary(job=job, rank=i * 8 + g, world_size=8 * len(members),
                                     node=node, gpu=g, pid=1000 + g, last_step=1000,
                                     last_step_time=now, step_seconds_p50=0.5,
                                     last_checkpoint_time=now - 3600, checkpoint_seconds=20.0)
                         for g in range(8)]
                await self.agents[node].post(ranks=ranks)
        self._polls = [asyncio.create_task(a.poll(self._stop)) for a in self.agents.values()]
        await asyncio.sleep(0.5)

    async def trial(self, trial: int) -> float:
        """One fatal finding from an agent; seconds until every node of its job has the
        order."""
        names = sorted(self.jobs)
        job = names[trial % len(names)]
        members = self.jobs[job]
        waits = [self.agents[n].wait_order(job) for n in members]
        reporter = self.agents[members[trial % len(members)]]
        finding = Finding(check="gpu_lost", health=Health.UNHEALTHY,
                          action=SuggestedAction.RESET_GPU, time=time.time(),
                          subject=Subject(kind="gpu", node=reporter.node, gpu=trial % 8),
                          reason=f"bench trial {trial}")
        t0 = time.perf_counter()
        await reporter.post(urgent=True, findings=[finding])
        done = await asyncio.wait_for(asyncio.gather(*waits), 60)
        for a in self.agents.values():
            a.waiters.clear()
        # The GPU comes back (the agent's healthy finding of the same check): its incident
        # ends, so a later trial on this GPU is a new incident that orders again.
        await reporter.post(findings=[msgspec.structs.replace(
            finding, health=Health.HEALTHY, action=SuggestedAction.NONE, time=time.time())])
        return max(done) - t0

    async def trials(self, first: int, count: int, gap: float) -> list[float]:
        """Latencies of ``count`` trials numbered from ``first``, ``gap`` s apart."""
        out = []
        for trial in range(first, first + count):
            out.append(await self.trial(trial))
            await asyncio.sleep(gap)
        return out

    async def close(self) -> None:
        self._stop.set()
        for a in self.agents.values():
            await a.client.aclose()
        for p in self._polls:
            p.cancel()
        await asyncio.gather(*self._polls, return_exceptions=True)


def summary(latencies: list[float]) -> dict[str, float]:
    """Trials, p50, p99 and max in milliseconds."""
    lat = sorted(latencies)
    return {
        "trials": len(lat),
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "max_ms": 1000 * lat[-1],
    }


async def drive(url: str, tokens: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    fleet = Fleet(url, tokens, args.job_nodes)
    await fleet.start()
    latencies = await fleet.trials(0, args.trials, args.gap)
    await fleet.close()
    return {"nodes": len(tokens), "job_nodes": args.job_nodes, **summary(latencies)}


BENCH_POLICY = (
    "policy_dedup_s = 0\npolicy_cooldown_checkpoint_s = 0\npolicy_cooldown_webhook_s = 0\n"
    "policy_rate_checkpoint_per_min = 1000000\npolicy_breaker_checkpoint_share = 1.0\n"
    "incident_window_s = 0.001\n")
"""Policy gates open, so every trial's finding acts."""


@contextlib.contextmanager
def collector_process(nodes: int, extra_config: str = ""
                      ) -> Iterator[tuple[str, dict[str, str], Path]]:
    """A real ``forewarn collector`` (pinned to core 0 when ``taskset`` exists) with
    ``nodes`` enrolled nodes and :data:`BENCH_POLICY`: (url, node -> token, data dir)."""
    tmp = Path(tempfile.mkdtemp(prefix="forewarn-order-bench-"))
    tokens = {f"n{i:04d}": f"bench-token-{i:04d}-0123456789" for i in range(nodes)}
    (tmp / "tokens.toml").write_text("".join(
        f'{n} = "{hash_token(t)}"\n' for n, t in tokens.items()))
    port = free_port()
    (tmp / "collector.toml").write_text(
        f'listen = "127.0.0.1:{port}"\ndata_dir = "{tmp / "data"}"\n'
        f'tokens_file = "{tmp / "tokens.toml"}"\nlog_level = "warning"\n'
        + BENCH_POLICY + extra_config)
    cmd = [sys.executable, "-m", "forewarn", "collector", "--config", str(tmp / "collector.toml")]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("collector did not start")
            time.sleep(0.1)
        yield url, tokens, tmp / "data"
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--job-nodes", type=int, default=8)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between trials")
    args = ap.parse_args()
    with collector_process(args.nodes) as (url, tokens, _data):
        result = asyncio.run(drive(url, tokens, args))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
