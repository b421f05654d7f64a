"""End to end: a real collector process, three real agents on simulated nodes, one training
job of six ranks across them (small processes using forewarn.hook.Monitor).

GPU 1 of node2 falls off the bus (sim ``sudden`` XID 79). node2's agent reports it, the
collector's policy weighs it (cost model), chooses one step S for the whole job and orders
every node; every rank on every node saves at that same S and reports it; a signed
webhook reaches a test receiver and its signature verifies.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.collector.decide.webhooks import WebhookVerifier
from forewarn.collector.http.auth import enroll

from support.polling import START_TIMEOUT_S, wait_for
from support.stack import Processes, start_agent, start_collector
from support.webhooks import Receiver

SECRET = "e2e-webhook-secret"
JOB = "e2e-job"
NODES = ("node1", "node2", "node3")

RANK = r'''
import sys, time
from pathlib import Path
from forewarn.hook import Monitor

job, rank, local, world, sock, out = sys.argv[1:7]
rank, local, world, out = int(rank), int(local), int(world), Path(out)
m = Monitor(job=job, rank=rank, world_size=world, local_rank=local, socket_path=sock,
            beat_interval_s=0.2, handle_sigterm=False)
step = 0
stop = out.with_suffix(".stop")
while not stop.exists():
    time.sleep(0.05)
    step += 1
    m.step(step, loss=1.0 / step)
    if m.should_checkpoint(step):
        t0 = time.monotonic()
        (out.parent / f"rank{rank}-step{step}.ckpt").write_bytes(b"x" * 1024)
        m.checkpoint_done(step, time.monotonic() - t0, 1024, str(out.parent))
        with out.open("a") as f:
            f.write(f"{step}\n")
m.close()
'''

HEALTHY = 'name = "healthy"\ngpus = 2\nseed = {seed}\n'
FAILING = ('name = "gpu1-off-the-bus"\ngpus = 2\nseed = 2\n\n[[faults]]\ngpu = 1\n'
           'kind = "sudden"\nxid = 79\nstart_s = {start}\nduration_s = 1\n')


@pytest.mark.timeout(180)
def test_failure_on_node2_gpu1_checkpoints_every_rank_at_one_step(tmp_path: Path) -> None:
    receiver = Receiver()
    procs = Processes(tmp_path)
    tokens = tmp_path / "tokens.toml"
    token_files = {node: tmp_path / f"{node}.token" for node in NODES}
    for node, token_file in token_files.items():
        enroll(tokens, node, token_file)
    try:
        # checkpoint_default_s: the job has run for seconds only; with the 60 s default the
        # cost model would (rightly) not find a few seconds of work worth a checkpoint.
        url = start_collector(procs, tokens, webhook_urls=[receiver.url],
                              webhook_secret=SECRET, checkpoint_default_s=0.5,
                              order_safety_s=2.0)
        sockets = {}
        for i, node in enumerate(NODES):
            sockets[node] = tmp_path / f"{node}.sock"
            start_agent(procs, node, FAILING.format(start=12) if node == "node2"
                        else HEALTHY.format(seed=i), socket=sockets[node], collector=url,
                        token_file=token_files[node], wait=False)
        procs.wait_for("agent sockets", lambda: all(s.exists() for s in sockets.values()),
                       START_TIMEOUT_S)

        rank_script = tmp_path / "rank.py"
        rank_script.write_text(RANK)
        outs = {}
        for rank in range(6):
            node = NODES[rank // 2]
            outs[rank] = tmp_path / f"rank{rank}.out"
            procs.spawn(f"rank{rank}", [sys.executable, str(rank_script), JOB, str(rank),
                                        str(rank % 2), "6", str(sockets[node]), str(outs[rank])])

        def job_known() -> bool:
            r = httpx.get(f"{url}/api/v1/jobs/{JOB}", timeout=2)
            return r.status_code == 200 and len(r.json().get("ranks", [])) == 6

        wait_for(job_known, 30, "the job map to hold all six ranks")

        # the failure (12 simulated seconds after node2's agent started) -> a collector order
        def collector_order() -> Any:
            decisions = httpx.get(f"{url}/api/v1/decisions", params={"job": JOB},
                                  timeout=2).json()
            return [d for d in decisions if d["decision"] == "checkpoint:act"]

        acted = wait_for(collector_order, 60, "the collector's checkpoint decision")
        inputs = json.loads(acted[0]["inputs"])
        assert inputs["check"] in ("gpu_lost", "xid") and inputs["gpus"] == 6

        def job_checkpoint() -> Any:
            rows = httpx.get(f"{url}/api/v1/checkpoints", params={"job": JOB, "limit": 1000},
                             timeout=2).json()
            by_request: dict[str, dict[int, int]] = {}
            for r in rows:
                if r["phase"] == "done" and r["request_id"].startswith("ord-"):
                    by_request.setdefault(r["request_id"], {})[r["rank"]] = r["step"]
            complete = {rid: steps for rid, steps in by_request.items() if len(steps) == 6}
            return complete

        complete = wait_for(job_checkpoint, 60, "every rank's report for a collector order")
        request_id, steps = next(iter(complete.items()))
        assert len(set(steps.values())) == 1, steps  # every rank saved the same step
        step = next(iter(steps.values()))
        # the ranks themselves saved that step (their own records and files)
        for rank, out in outs.items():
            saved = [int(s) for s in out.read_text().split()]
            assert step in saved, (rank, saved)
            assert (tmp_path / f"rank{rank}-step{step}.ckpt").exists()
        # the order went to every node, and each agent acknowledged it
        log = httpx.get(f"{url}/api/v1/commands/log", params={"limit": 1000}, timeout=2).json()
        acked = {c["node"] for c in log if c["id"].startswith(request_id + "@")
                 and c["acked_at"] is not None}
        assert acked == set(NODES)

        # a signed webhook about the failure arrived and verifies
        def signed_event() -> Any:
            verifier = WebhookVerifier(SECRET.encode(), tolerance_s=600)
            for headers, body in list(receiver.requests):
                verifier.verify(body, headers)
                event = json.loads(body)
                if event.get("subject") == "gpu:node2/1":
                    return event
            return None

        event = wait_for(signed_event, 30, "a signed webhook")
        assert event["node"] == "node2" and event["health"] == "unhealthy"
        print(f"order {request_id}: every rank saved step {step}; "
              f"decision: {acted[0]['reason']}; webhook: {event['title']}")
    finally:
        for rank in range(6):
            (tmp_path / f"rank{rank}.stop").touch()
        procs.close()
        receiver.close()
