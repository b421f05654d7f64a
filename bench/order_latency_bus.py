"""Order latency through NATS JetStream under fleet load: from a fatal event on one agent
to every node of its job holding the checkpoint order, while the fleet publishes telemetry.

A nats-server (JetStream, file storage) and one real ``forewarn collector`` process with
``bus_url`` (embedded SQLite state, so it leads; the policy gates open as in
``bench/order_latency.py``; predictor and goodput on, as shipped). In this process a load
generator publishes as agents do: ``--nodes`` nodes x ``--gpus`` GPUs at one sample per GPU
per second, each node one batch per ``--push-interval`` s (8 GPUs x 5 s = 40 samples, the
agent's default), JetStream publish with ``Nats-Msg-Id``, the realistic 1.6 KB samples of
``bench/collector_ingest.py`` with advancing times. The nodes of ``--jobs`` jobs of
``--job-nodes`` nodes also carry their ranks in every batch and pull their commands through
their own durable consumer, answering each (as ``agent/bus.py`` does).

Each trial: one node of a job publishes an urgent batch with an unhealthy ``gpu_lost``
finding (what an agent sends on a fatal XID), on the urgent lane
(``forewarn.urgent.<node>``) as the agent does; the latency is until the last node of that
job has received the order (the agent -> rank leg is a local datagram: ``bench/hook_step.py``).
Reported: p50/p99/max, the GPU-samples/s the collector stored meanwhile against what was
offered, its stream backlog (batches published and not yet taken: the rate is sustained
when it stays flat), the collector's, nats-server's and the generator's CPU, and per trial
where the time went from the collector's own records (``stages``: seconds after the
finding until the urgent batch was handed to the writer, the order's rows were queued
first and last, and last taken by the bus publisher; the rest is nats-server and the
bench's pull), and the collector's own split of the batch's way to the decision
(``split``: ``forewarn_collector_urgent_seconds{stage}`` read from ``/metrics`` before and
after each trial; ``split_p50``/``split_max`` over the trials; empty for a collector
without that metric), with its group commits and those cut short per second.

The generator is split so that it does not measure itself: ``--publishers`` processes
(this script with ``--publish``) publish the telemetry of the nodes outside the jobs, each
a slice of them; this process publishes the job nodes' batches (with their ranks), pulls
their commands and runs the trials, so the order is seen as it arrives, not behind 500
publishes a second on one event loop.

    python bench/order_latency_bus.py --nodes 2500 --trials 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from prometheus_client.parser import text_string_to_metric_families

from forewarn import bus
from forewarn.wire import (
    AgentBatch,
    Command,
    CommandAck,
    Finding,
    Health,
    RankSummary,
    Subject,
    SuggestedAction,
    encode_json,
)

sys.path.insert(0, str(Path(__file__).parent))
from bus_ingest import start_nats, wait_consumer
from collector_ingest import cpu_seconds, free_port, make_samples
from order_latency import BENCH_POLICY, summary

ENCODER = msgspec.msgpack.Encoder()
TRIAL_LIMIT_S = 60.0
"""A trial whose order has not reached every node by then counts as this long."""


class Node:
    """One simulated agent: telemetry batches, and for job nodes ranks and commands."""

    def __init__(self, name: str, gpus: int, push_s: float) -> None:
        self.name = name
        self.subjects = {lane: bus.subject(lane, name)
                         for lane in (bus.BATCH_PREFIX, bus.URGENT_PREFIX)}
        self.template = make_samples(name, gpus, 1, 0.0)
        self.push_s = push_s
        self.seq = 0
        self.ranks: list[RankSummary] = []
        self.waiters: list[tuple[str, asyncio.Future[float]]] = []

    async def publish(self, js: JetStreamContext, **kw: Any) -> int:
        """One batch (on the urgent lane when it carries findings, as the agent sends
        it); returns its size in bytes."""
        # Take the seq before awaiting: a trial publishes while this node's telemetry
        # loop awaits its own publish, and two batches under one seq would be one
        # (JetStream's duplicate window drops the second: the trial's order never came).
        seq, self.seq = self.seq, self.seq + 1
        urgent = bool(kw.get("findings") or kw.get("checkpoints"))
        body = ENCODER.encode(AgentBatch(node=self.name, agent_id=self.name, seq=seq,
                                         created=time.time(), urgent=urgent, **kw))
        lane = bus.URGENT_PREFIX if urgent else bus.BATCH_PREFIX
        await js.publish(self.subjects[lane], body,
                         headers={"Nats-Msg-Id": f"{self.name}:{seq}"})
        return len(body)

    def telemetry(self, end: float) -> list[Any]:
        """The samples of the last push interval: one per GPU per second up to ``end``."""
        n = round(self.push_s)
        return [msgspec.structs.replace(s, time=end - n + 1 + i)
                for i in range(n) for s in self.template]

    async def commands(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        """Pull this node's commands and answer each, as the agent's NATS uplink does."""
        sub = await js.pull_subscribe(bus.subject(bus.COMMAND_PREFIX, self.name),
                                      durable=bus.command_consumer(self.name),
                                      stream=bus.COMMAND_STREAM,
                                      config=ConsumerConfig(ack_wait=10.0))
        while not stop.is_set():
            try:
                msgs = await sub.fetch(16, timeout=1.0)
            except TimeoutError:  # nats-py raises its own and asyncio's
                continue
            now = time.perf_counter()
            for msg in msgs:
                c = msgspec.json.decode(msg.data, type=Command)
                if c.order is not None:
                    for job, fut in self.waiters:
                        if job == c.order.job and not fut.done():
                            fut.set_result(now)
                await js.publish(bus.subject(bus.ACK_PREFIX, self.name),
                                 encode_json(CommandAck(id=c.id, node=self.name, ok=True,
                                                        time=time.time())),
                                 headers={"Nats-Msg-Id": f"ack:{c.id}"})
                await msg.ack()

    def wait_order(self, job: str) -> asyncio.Future[float]:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiters.append((job, fut))
        return fut


class Load:
    """Every node publishing its telemetry every push interval, spread evenly."""

    def __init__(self, js: JetStreamContext, nodes: list[Node], push_s: float) -> None:
        self.js, self.nodes, self.push_s = js, nodes, push_s
        self.stop = asyncio.Event()
        self.published = 0
        self.samples = 0
        self.bytes = 0
        self.late = 0.0  # how far behind schedule the generator fell, at most

    async def node_loop(self, i: int, node: Node) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.push_s * i / len(self.nodes)
        while not self.stop.is_set():
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.late = max(self.late, -delay)
            due += self.push_s
            samples = node.telemetry(time.time())
            size = await node.publish(self.js, samples=samples, ranks=node.ranks)
            self.bytes += size  # (not ``+= await``: that reads the sum before awaiting)
            self.published += 1
            self.samples += len(samples)

    async def run(self) -> None:
        await asyncio.gather(*(self.node_loop(i, n) for i, n in enumerate(self.nodes)))


async def backlog(js: JetStreamContext) -> tuple[int, int]:
    """(batches acknowledged by the collector, batches published and not yet taken)."""
    info = await js.consumer_info(bus.BATCH_STREAM, bus.BATCH_CONSUMER)
    acked = int(info.delivered.consumer_seq or 0) - int(info.num_ack_pending or 0)
    return acked, int(info.num_pending or 0) + int(info.num_ack_pending or 0)


def jobs_of(nodes: list[Node], jobs: int, job_nodes: int) -> dict[str, list[Node]]:
    """``jobs`` jobs of ``job_nodes`` nodes (8 ranks each), their ranks set on the nodes."""
    out = {}
    now = time.time()
    for j in range(jobs):
        members = nodes[j * job_nodes:(j + 1) * job_nodes]
        job = f"job{j}"
        for k, node in enumerate(members):
            node.ranks = [RankSummary(job=job, rank=k * 8 + g, world_size=8 * len(members),
                                      node=node.name, gpu=g, pid=1000 + g, last_step=1000,
                                      last_step_time=now, step_seconds_p50=0.5,
                                      last_checkpoint_time=now - 3600, checkpoint_seconds=20.0)
                          for g in range(8)]
        out[job] = members
    return out


class Trial(msgspec.Struct):
    """One trial: when the finding was made (Unix time), by which node, in which batch,
    to which job's nodes, the latency measured, and the collector's own split of its
    urgent batch's way to the decision (``urgent_seconds``, seconds per stage; empty for
    a collector without that metric)."""

    made: float
    node: str
    seq: int
    nodes: list[str]
    latency: float = 0.0
    split: dict[str, float] = msgspec.field(default_factory=dict)


URGENT = "forewarn_collector_urgent_seconds"
GROUP = "forewarn_collector_ingest_group_size"
CUT = "forewarn_collector_ingest_commits_cut"


class Stages:
    """The collector's ``urgent_seconds{stage}`` sums and counts, read from ``/metrics``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def families(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url, timeout=30) as r:
            text = r.read().decode()
        return {fam.name: fam for fam in text_string_to_metric_families(text)}

    def commits(self) -> dict[str, float]:
        """The collector's group commits so far, and those cut short (where counted)."""
        fams = self.families()
        out = {"group_commits": sum(s.value for s in fams[GROUP].samples
                                    if s.name == GROUP + "_count")}
        if CUT in fams:
            out["commits_cut"] = sum(s.value for s in fams[CUT].samples
                                     if s.name == CUT + "_total")
        return out

    def read(self) -> dict[str, tuple[float, float]] | None:
        """stage -> (sum, count); None when the collector has no such metric."""
        out: dict[str, list[float]] = {}
        families = self.families()
        if URGENT not in families:
            return None
        for s in families[URGENT].samples:
            pair = out.setdefault(s.labels.get("stage", ""), [0.0, 0.0])
            if s.name == URGENT + "_sum":
                pair[0] = s.value
            elif s.name == URGENT + "_count":
                pair[1] = s.value
        return {k: (v[0], v[1]) for k, v in out.items()}

    async def settled(self, decided: int) -> dict[str, tuple[float, float]] | None:
        """The figures once ``decided`` urgent batches went through the policy (up to
        10 s): a trial's split then holds its own batch only."""
        deadline = time.monotonic() + 10.0
        while True:
            now = await asyncio.to_thread(self.read)
            if now is None or now.get("decide", (0, 0))[1] >= decided or \
                    time.monotonic() > deadline:
                return now
            await asyncio.sleep(0.1)  # a scrape costs the collector ~10 ms


def split_summary(splits: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per stage of the collector's split: the median and the largest of the trials."""
    keys = sorted({k for sp in splits for k in sp})
    per = {k: sorted(sp[k] for sp in splits if k in sp) for k in keys}
    return {"split_p50": {k: v[len(v) // 2] for k, v in per.items()},
            "split_max": {k: v[-1] for k, v in per.items()}}


def split_of(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
             ) -> dict[str, float]:
    """Seconds per stage between two readings."""
    return {k: round(after[k][0] - before.get(k, (0.0, 0.0))[0], 4) for k in sorted(after)}


async def trial(js: JetStreamContext, jobs: dict[str, list[Node]], n: int,
                meter: Stages) -> Trial:
    """One fatal finding from an agent; seconds until every node of its job has the order.
    Each trial sends two urgent batches (the finding, then its recovery)."""
    before = await meter.settled(2 * n)
    job = sorted(jobs)[n % len(jobs)]
    members = jobs[job]
    waits = [m.wait_order(job) for m in members]
    reporter = members[n % len(members)]
    finding = Finding(check="gpu_lost", health=Health.UNHEALTHY,
                      action=SuggestedAction.RESET_GPU, time=time.time(),
                      subject=Subject(kind="gpu", node=reporter.name, gpu=n % 8),
                      reason=f"bench trial {n}")
    out = Trial(made=finding.time, node=reporter.name, seq=reporter.seq,
                nodes=[m.name for m in members])
    t0 = time.perf_counter()
    await reporter.publish(js, findings=[finding])  # takes reporter.seq before awaiting
    try:
        out.latency = max(await asyncio.wait_for(asyncio.gather(*waits), TRIAL_LIMIT_S)) - t0
    except TimeoutError:  # counted at the limit (a lower bound), the run goes on
        out.latency = TRIAL_LIMIT_S
        print(f"trial {n}: no order within {TRIAL_LIMIT_S:g} s", file=sys.stderr, flush=True)
    for m in members:
        m.waiters.clear()
    after = None if before is None else await meter.settled(2 * n + 1)
    if before is not None and after is not None:
        out.split = split_of(before, after)
    # The GPU comes back: its incident ends, so a later trial on it orders again.
    await reporter.publish(js, findings=[msgspec.structs.replace(
        finding, health=Health.HEALTHY, action=SuggestedAction.NONE, time=time.time())])
    return out


async def stream_seq(js: JetStreamContext) -> int:
    """The batch stream's last sequence number: batches published so far."""
    return int((await js.stream_info(bus.BATCH_STREAM)).state.last_seq)


def start_publishers(url: str, args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    """``--publishers`` processes publishing the telemetry of the nodes outside the jobs."""
    common = [f"--nodes={args.nodes}", f"--gpus={args.gpus}",
              f"--push-interval={args.push_interval}", f"--jobs={args.jobs}",
              f"--job-nodes={args.job_nodes}"]
    return [subprocess.Popen([sys.executable, __file__, "--publish", url,
                              f"--slice={i}/{args.publishers}", *common],
                             stdout=subprocess.PIPE)
            for i in range(args.publishers)]


def stop_publishers(procs: list[subprocess.Popen[bytes]]) -> float:
    """Stop them; returns how far behind schedule the furthest fell (seconds)."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    late = 0.0
    for p in procs:
        out, _ = p.communicate(timeout=60)
        late = max(late, float(json.loads(out.decode().strip().splitlines()[-1])["late"]))
    return late


async def publish_slice(url: str, args: argparse.Namespace) -> None:
    """``--publish``: publish this slice's telemetry until SIGTERM; print how late it got."""
    index, count = (int(x) for x in args.slice.split("/"))
    nodes = [Node(f"n{i:05d}", args.gpus, args.push_interval)
             for i in range(args.jobs * args.job_nodes, args.nodes)][index::count]
    nc = await nats.connect(url)
    load = Load(nc.jetstream(timeout=30), nodes, args.push_interval)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, load.stop.set)
    await load.run()
    await nc.close()
    print(json.dumps({"late": load.late, "published": load.published}), flush=True)


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


async def drive(url: str, procs: dict[str, int], args: argparse.Namespace,
                meter: Stages) -> dict[str, Any]:
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=30)
    await wait_consumer(js, 180)
    print("collector consuming; load starts", file=sys.stderr, flush=True)
    nodes = [Node(f"n{i:05d}", args.gpus, args.push_interval)
             for i in range(args.jobs * args.job_nodes)]
    jobs = jobs_of(nodes, args.jobs, args.job_nodes)
    publishers = start_publishers(url, args)
    gen_pids = [p.pid for p in publishers]

    def cpu() -> dict[str, float]:
        out = {k: cpu_seconds(p) for k, p in procs.items()}
        out["generator"] = own_cpu_seconds() + sum(cpu_seconds(p) for p in gen_pids)
        return out

    stop = asyncio.Event()
    pullers = [asyncio.create_task(m.commands(js, stop)) for ms in jobs.values() for m in ms]
    load = Load(js, nodes, args.push_interval)
    gen = asyncio.create_task(load.run())
    try:
        await asyncio.sleep(args.warmup)
        acked0, seq0, cpu0, t0 = (await backlog(js))[0], await stream_seq(js), cpu(), \
            time.perf_counter()
        commits0 = await asyncio.to_thread(meter.commits)
        backlogs = []
        results: list[Trial] = []
        print("trials start", file=sys.stderr, flush=True)
        for n in range(args.trials):
            results.append(await trial(js, jobs, n, meter))
            print(f"trial {n}: {results[-1].latency:.3f} s {results[-1].split}",
                  file=sys.stderr, flush=True)
            backlogs.append((await backlog(js))[1])
            await asyncio.sleep(args.gap)
        acked1, seq1, t1, cpu1 = (await backlog(js))[0], await stream_seq(js), \
            time.perf_counter(), cpu()
        commits1 = await asyncio.to_thread(meter.commits)
    finally:
        late = stop_publishers(publishers)
    load.stop.set()
    stop.set()
    await gen
    await asyncio.gather(*pullers, return_exceptions=True)
    await nc.close()
    secs = t1 - t0
    per_batch = args.gpus * round(args.push_interval)
    return {
        "gpus": args.nodes * args.gpus, "nodes": args.nodes, "job_nodes": args.job_nodes,
        "publishers": args.publishers,
        **summary([r.latency for r in results]),
        "trials_at_limit": sum(r.latency >= TRIAL_LIMIT_S for r in results),
        "offered_gpu_samples_per_s": args.nodes * args.gpus,
        "published_gpu_samples_per_s": (seq1 - seq0) * per_batch / secs,
        "stored_gpu_samples_per_s": (acked1 - acked0) * per_batch / secs,
        "backlog_batches_first": backlogs[0], "backlog_batches_last": backlogs[-1],
        "backlog_batches_max": max(backlogs),
        "generator_behind_s": max(late, load.late),
        "batch_bytes": load.bytes / max(1, load.published),
        **{f"{k}_cpu_pct": 100 * (cpu1[k] - cpu0[k]) / secs for k in cpu1},
        "load_average": os.getloadavg()[0],
        **{f"{k}_per_s": (commits1[k] - commits0[k]) / secs for k in commits1},
        **split_summary([r.split for r in results]),
        "trials_detail": results,
    }


def stages(db: Path, trials: list[Trial]) -> list[dict[str, Any]]:
    """Per trial, from the collector's records, seconds after the finding: the urgent batch
    handed to the writer, the order's rows queued (first, last), last taken by the
    publisher; and the bench's latency (until the last node pulled it)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    out = []
    ends = [t.made for t in trials[1:]] + [float("inf")]
    for t, end in zip(trials, ends, strict=True):
        received = conn.execute("SELECT received FROM batches WHERE agent_id = ? AND seq = ?",
                                (t.node, t.seq)).fetchone()
        marks = ", ".join("?" * len(t.nodes))
        queued = conn.execute(
            "SELECT MIN(created), MAX(created), MAX(delivered_at) FROM commands WHERE"
            f" kind = 'checkpoint' AND node IN ({marks}) AND created >= ? AND created < ?",
            (*t.nodes, t.made, end)).fetchone()
        out.append({"writer": _after(received[0] if received else None, t.made),
                    "queued_first": _after(queued[0], t.made),
                    "queued_last": _after(queued[1], t.made),
                    "taken_last": _after(queued[2], t.made), "latency": round(t.latency, 3),
                    "split": t.split})
    conn.close()
    return out


def _after(when: float | None, made: float) -> float | None:
    return None if when is None else round(when - made, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2500)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--push-interval", type=float, default=5.0)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--job-nodes", type=int, default=8)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between trials")
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--publishers", type=int, default=2,
                    help="processes publishing the telemetry of the nodes outside the jobs")
    ap.add_argument("--publish", metavar="NATS_URL", help=argparse.SUPPRESS)
    ap.add_argument("--slice", default="0/1", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publish:
        asyncio.run(publish_slice(args.publish, args))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fw-order-bus-"))
    nats_proc, url = start_nats(tmp)
    port = free_port()
    (tmp / "collector.toml").write_text(
        f'listen = "127.0.0.1:{port}"\ndata_dir = "{tmp / "data"}"\n'
        f'tokens_file = "{tmp / "tokens.toml"}"\nlog_level = "warning"\n'
        f'bus_url = "{url}"\n' + BENCH_POLICY)
    collector = subprocess.Popen([sys.executable, "-m", "forewarn", "collector", "--config",
                                  str(tmp / "collector.toml")])
    try:
        result = asyncio.run(drive(url, {"collector": collector.pid, "nats": nats_proc.pid},
                                   args, Stages(f"http://127.0.0.1:{port}/metrics")))
        collector.terminate()
        collector.wait(60)
        result["stages"] = stages(tmp / "data" / "collector.db", result.pop("trials_detail"))
    finally:
        collector.terminate()
        collector.wait(60)
        nats_proc.terminate()
        nats_proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    slowest = max(result["stages"], key=lambda st: st["latency"])
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                      for k, v in result.items() if k != "stages"}))
    print(json.dumps({"slowest_trial": slowest, "stages": result["stages"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
