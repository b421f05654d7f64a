"""The scale-out faults of the chaos suite (issue 16), on the lab's
:class:`~forewarn.chaos.scale_lab.ScaleRig`: a collector replica SIGKILLed during ingest and
during an order, PostgreSQL restarted under load, one server of the 3-server JetStream
cluster killed. Each ends by accounting every batch the agents sealed (in PostgreSQL) and
every GPU sample (in VictoriaMetrics, once): nothing may be lost or duplicated.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forewarn.chaos.outcome import Outcome, Scenario
from forewarn.chaos.scale_lab import NODES, ScaleRig, scale_rig
from forewarn.demo import servers
from forewarn.demo.launch import python_module
from forewarn.spawn import workload
from forewarn.spawn.procs import get_json, readyz, wait_until

if TYPE_CHECKING:
    from forewarn.chaos.lab import Lab

__all__ = ["SCALE_SCENARIOS"]

TAKEOVER_S = 5.0
"""The issue's bound: the other replica leads within 5 s of a SIGKILL."""
ORDER_JOB = "chaos-scale-order"


def _rig(lab: Lab, out: Outcome) -> ScaleRig | None:
    missing = servers.scale_out_missing()
    if missing:
        out.skipped = "; ".join(missing)
        return None
    return scale_rig(lab)


def _account(rig: ScaleRig, out: Outcome) -> None:
    """Settle and account; nothing lost or duplicated."""
    acc = rig.settle()
    out.figures.update(rig.as_figures(acc))
    for problem in acc.shortfalls():
        out.expect(False, problem)
    out.lost = (f"nothing: {acc.batches_stored}/{acc.batches_sealed} batches in PostgreSQL, "
                f"{acc.samples_stored}/{acc.samples_sent} samples in VictoriaMetrics, "
                f"{acc.samples_duplicated} twice") if not acc.shortfalls() else \
        "; ".join(acc.shortfalls())


def _takeover(rig: ScaleRig, out: Outcome) -> tuple[str, float]:
    """SIGKILL the leader, check the takeover time; returns the killed replica and when."""
    dead, at, took = rig.kill_leader()
    out.figures.update(killed=dead, takeover_s=took)
    out.expect(took is not None and took < TAKEOVER_S,
               f"the other replica led {took} s after the SIGKILL (bound {TAKEOVER_S} s)")
    out.detected = f"the follower took the lead {took} s after {dead} was SIGKILLed"
    out.detection_s = took
    return dead, at


def replica_killed_during_ingest(lab: Lab, out: Outcome) -> None:
    rig = _rig(lab, out)
    if rig is None:
        return
    out.expect(rig.ingesting(), "the agents' batches were not being stored")
    dead, _at = _takeover(rig, out)
    out.expect(rig.ingesting(), "ingest did not go on on the surviving replica")
    rig.start_replica(dead)
    out.action = (f"SIGKILL {dead} while 2 agents publish; its unacknowledged batches "
                  "redelivered to the other; restarted")
    _account(rig, out)


def postgres_restart(lab: Lab, out: Outcome) -> None:
    rig = _rig(lab, out)
    if rig is None:
        return
    out.expect(rig.ingesting(), "the agents' batches were not being stored")
    retries0 = rig.metric("forewarn_collector_store_retries_total")
    t0 = time.monotonic()
    rig.pg.restart()
    restarted = time.monotonic() - t0
    ready = wait_until(lambda: all(readyz(u, timeout=2)[0] == 200 for u in rig.urls.values()),
                       60)
    back = round(time.monotonic() - t0, 2)
    out.expect(ready is not None, "a replica did not get ready again after the restart")
    out.expect(rig.ingesting(), "ingest did not resume after the restart")
    retries = rig.metric("forewarn_collector_store_retries_total") - retries0
    out.figures.update(restart_s=round(restarted, 2), ready_again_s=back,
                       store_retries=int(retries))
    out.detected = (f"replicas: {int(retries)} group commits retried; both ready again "
                    f"{back} s after the restart began")
    out.detection_s = back
    out.action = "pg_ctl restart -m fast while 2 agents publish through 2 replicas"
    _account(rig, out)


def jetstream_node_killed(lab: Lab, out: Outcome) -> None:
    rig = _rig(lab, out)
    if rig is None:
        return
    out.expect(rig.ingesting(), "the agents' batches were not being stored")
    victim = rig.nats[0]
    victim.kill()
    t0 = time.monotonic()
    went_on = rig.ingesting(more=10)
    took = round(time.monotonic() - t0, 2)
    out.expect(went_on, "ingest did not go on with 2 of 3 NATS servers")
    victim.start()
    out.figures.update(killed_server=victim.name, ingest_on_s=took)
    out.detected = f"clients moved to the other servers; 10 more batches stored in {took} s"
    out.detection_s = took
    out.action = f"SIGKILL nats-server {victim.name} of 3 (streams R3); restarted"
    _account(rig, out)


def replica_killed_series_backlog(lab: Lab, out: Outcome) -> None:
    """The series store stalls (SIGSTOP) while the agents publish, so each replica holds
    samples it has stored in PostgreSQL and acknowledged on the bus but not yet written to
    VictoriaMetrics; then a replica is SIGKILLed and the store resumes."""
    rig = _rig(lab, out)
    if rig is None:
        return
    out.expect(rig.ingesting(), "the agents' batches were not being stored")
    queued0 = rig.metric("forewarn_collector_remote_write_queued_samples")
    rig.vm.proc.send_signal(signal.SIGSTOP)
    try:
        out.expect(rig.ingesting(more=20), "ingest stopped while the series store stalled")
        queued = rig.metric("forewarn_collector_remote_write_queued_samples") - queued0
        dead, _at = _takeover(rig, out)
    finally:
        rig.vm.proc.send_signal(signal.SIGCONT)
    rig.start_replica(dead)
    out.figures["queued_at_kill"] = int(queued)
    _account(rig, out)
    # the survivor took the batches the dead one held unacknowledged and sent them again
    resent = int(rig.metric("forewarn_collector_remote_write_resent_samples_total"))
    out.figures["samples_resent"] = resent
    out.action = (f"VictoriaMetrics stopped (SIGSTOP) while 2 agents publish; {dead} "
                  f"SIGKILLed holding {int(queued)} queued samples (both replicas); resumed;"
                  f" {resent} samples of batches delivered again sent again")


# --------------------------------------------------------------------------- the order

def _order_job(lab: Lab, rig: ScaleRig) -> dict[int, Path]:
    """A 2-rank hook-only job: rank 0 on node 1, rank 1 on node 3 (the GPU that will fail).
    Returns each rank's event log."""
    logs = {}
    for rank, node, gpu in ((0, NODES[0], 1), (1, NODES[2], 0)):
        log = rig.dir / f"order-rank{rank}.jsonl"
        lab.procs.spawn(f"order-rank{rank}", python_module(
            workload.__name__, "light", "--job", ORDER_JOB, "--gpu", str(gpu),
            "--rank", str(rank), "--world-size", "2", "--socket", rig.agents[node].socket,
            "--checkpoint-dir", str(rig.dir / f"order-ckpt-{rank}")), log)
        logs[rank] = log
    return logs


def _events(log: Path, event: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and e.get("event") == event:
            out.append(e)
    return out


FAIL_AT_S = 20.0
"""When node 3's GPU 0 falls off the bus (XID 79), seconds after its agent starts: the
job has run and saved its first checkpoint by then."""


def replica_killed_during_order(lab: Lab, out: Outcome) -> None:
    rig = _rig(lab, out)
    if rig is None:
        return
    node = NODES[2]
    rig.start_agent(node, f'name = "{node}"\ndescription = "GPU 0 falls off the bus"\n'
                    f'gpus = 4\nseed = 6\n\n[[faults]]\ngpu = 0\nkind = "sudden"\n'
                    f"start_s = {FAIL_AT_S}\nxid = 79\n")
    logs = _order_job(lab, rig)
    try:
        _order_under_failover(rig, out, node, logs)
    finally:
        for rank in logs:
            lab.procs.stop(f"order-rank{rank}")
    _account(rig, out)


def _order_under_failover(rig: ScaleRig, out: Outcome, node: str,
                          logs: dict[int, Path]) -> None:
    url = rig.survivor()
    xid = wait_until(lambda: get_json(f"{url}/api/v1/xids?node={node}&code=79"),
                     FAIL_AT_S + 60, step=0.05)
    if not out.expect(bool(xid), "the XID 79 never reached the collectors"):
        return
    # the fatal finding is in: the leader is deciding or has just queued the order
    dead, killed_at = _takeover(rig, out)
    saved = wait_until(lambda: all(_ordered(logs[r]) for r in logs), 30)
    out.expect(saved is not None, "not every rank saved an ordered checkpoint")
    time.sleep(2 * 2.0)  # two command_redeliver_s periods: a repeated delivery would show
    rig.start_replica(dead)
    cmds = [c for c in get_json(rig.survivor() + "/api/v1/commands/log?limit=10000")
            if c.get("kind") == "checkpoint" and c["command"]["order"].get("job") == ORDER_JOB]
    nodes = sorted({c["node"] for c in cmds})
    # whether the dead leader had queued the order, or the new one decided it
    out.figures["queued_after_kill"] = bool(cmds) and min(c["created"] for c in cmds) > killed_at
    out.figures.update(orders=len(cmds), orders_acked=sum(1 for c in cmds if c["acked_at"]),
                       deliveries=sum(int(c["deliveries"] or 0) for c in cmds),
                       rank1_ordered_saves=len(_ordered(logs[1])))
    out.expect(nodes == sorted([NODES[0], node]),
               f"the job-wide order went to {nodes}, not both nodes of the job")
    out.expect(all(c["acked_at"] for c in cmds), "an order was not acknowledged")
    _one_order_per_incident(rig, out)
    _healthy_rank_saved(rig, out, [c["command"]["order"] for c in cmds
                                   if c["node"] == NODES[0]], logs[0])
    out.action = (f"XID 79 on {node}: job-wide checkpoint order; {dead} SIGKILLed as the "
                  "finding arrived; every rank saved once")
    _keep_evidence(rig, out, killed_at)


def _one_order_per_incident(rig: ScaleRig, out: Outcome) -> None:
    """Across the takeover, no incident ordered the job twice (unless it escalated): the
    old leader's order and the new one's decision of the same fault are one order (the
    same finding decided by both is the same order id; a reissue names no decision)."""
    url = rig.survivor()
    incident_of = {}
    for d in get_json(f"{url}/api/v1/decisions?job={ORDER_JOB}&limit=1000"):
        if d["decision"] == "checkpoint:act" and not d["reason"].startswith("incident escalated"):
            inputs = json.loads(d["inputs"])
            incident_of[inputs.get("id")] = str(inputs.get("incident"))
    orders: dict[str, set[str]] = {}
    for a in get_json(f"{url}/api/v1/actions?job={ORDER_JOB}&kind=checkpoint&limit=1000"):
        detail = json.loads(a["detail"])
        incident = incident_of.get(detail.get("decision"))
        if a["status"] == "ordered" and incident is not None:
            orders.setdefault(incident, set()).add(str(detail.get("request_id")))
    out.figures["checkpoint_decisions"] = len(incident_of)
    twice = {i: sorted(ids) for i, ids in orders.items() if len(ids) > 1}
    out.expect(not twice, f"an incident ordered the job more than once: {twice}")


def _healthy_rank_saved(rig: ScaleRig, out: Outcome, orders: list[dict[str, Any]],
                        log: Path) -> None:
    """Rank 0's node saw no fault: the collector's orders (``orders``, to its node) are its
    only ones. It saves once at each ordered step, but at the step of an order it reported
    missed (the order reached it after that step, e.g. delivered late on a loaded machine):
    that order was reissued for a later step, one of ``orders`` too."""
    reports = get_json(f"{rig.survivor()}/api/v1/checkpoints?job={ORDER_JOB}&limit=1000")
    missed_ids = {r["request_id"] for r in reports if r["rank"] == 0 and r["phase"] == "missed"}
    missed = {o["step"] for o in orders if o["request_id"] in missed_ids}
    steps = {o["step"] for o in orders}
    # an order is applied when the rank reaches its step: a later order's may still be ahead
    wait_until(lambda: {e["step"] for e in _ordered(log)} >= steps - missed or None, 30)
    saved = [e["step"] for e in _ordered(log)]
    out.figures.update(rank0_orders=len(orders), rank0_order_steps=len(steps),
                       rank0_missed_steps=len(missed), rank0_ordered_saves=len(saved))
    out.expect(len(saved) == len(set(saved)), f"rank 0 saved a step twice: {saved}")
    out.expect(set(saved) == steps - missed,
               f"rank 0 saved at steps {sorted(saved)} for {len(orders)} order(s) at steps "
               f"{sorted(steps)}, of which it missed {sorted(missed)}")


def _keep_evidence(rig: ScaleRig, out: Outcome, killed_at: float) -> None:
    """The order's decisions, actions, rank reports, incidents and commands as the shared
    state has them, kept in ``order-evidence.json`` in the rig's directory (beside the
    replicas' logs); on a failure its story goes into the figures too (a CI log shows
    those), each line with its time since the kill: before it, the killed leader decided."""
    url = rig.survivor()
    evidence: dict[str, Any] = {name: get_json(f"{url}/api/v1/{name}?{query}") for name, query in (
        ("decisions", f"job={ORDER_JOB}&limit=1000"), ("actions", f"job={ORDER_JOB}&limit=1000"),
        ("checkpoints", f"job={ORDER_JOB}&limit=1000"), ("incidents", "limit=100"),
        ("commands/log", "limit=10000"))}
    evidence["killed_at"] = killed_at
    (rig.dir / "order-evidence.json").write_text(json.dumps(evidence, indent=1, default=str))
    if out.problems:
        out.figures["order_story"] = [line for _t, line in sorted(_story(evidence, killed_at))]


def _story(evidence: dict[str, Any], killed_at: float) -> list[tuple[float, str]]:
    """(time, line) of each checkpoint decision, order queued or reissued, and rank
    report under an order."""
    out = []
    for d in evidence["decisions"]:
        if str(d["decision"]).startswith("checkpoint:"):
            i = json.loads(d["inputs"])
            out.append((d["time"], f"{d['decision']} {i.get('id')} {i.get('source')} "
                        f"{i.get('check')} {d['subject']} incident={i.get('incident')}: "
                        f"{d['reason']}"))
    for a in evidence["actions"]:
        if a["kind"] == "checkpoint":
            detail = json.loads(a["detail"])
            out.append((a["time"], f"action {a['status']} {detail.get('request_id')} step "
                        f"{detail.get('step')} decision={detail.get('decision')} "
                        f"replaces={detail.get('replaces')}"))
    for c in evidence["checkpoints"]:
        if c.get("request_id"):
            out.append((c["time"], f"rank {c['rank']} {c['phase']} {c['request_id']} "
                        f"at step {c['step']}"))
    return [(t, f"{t - killed_at:+.2f}s {line}") for t, line in out]


def _ordered(log: Path) -> list[dict[str, Any]]:
    return [e for e in _events(log, "checkpoint") if e.get("ordered")]



SCALE_SCENARIOS = (
    Scenario("replica_killed_ingest", "scale",
             "2 collector replicas on NATS JetStream + PostgreSQL + VictoriaMetrics, 2 agents "
             f"publishing; SIGKILL the leader: the other leads within {TAKEOVER_S:g} s, no "
             "batch lost, no sample lost or duplicated in the series store",
             replica_killed_during_ingest),
    Scenario("replica_killed_order", "scale",
             "a GPU falls off the bus (XID 79) under a 2-node job; SIGKILL the leading replica "
             f"as the finding arrives: the other leads within {TAKEOVER_S:g} s, the job-wide "
             "checkpoint order reaches both nodes, is acknowledged, no incident orders the "
             "job twice, and the healthy node's rank saves once per ordered step (a step it "
             "missed: at the reissued one)", replica_killed_during_order),
    Scenario("postgres_restart", "scale",
             "pg_ctl restart -m fast under load: the replicas retry and get ready again; no "
             "batch lost, no sample lost or duplicated", postgres_restart),
    Scenario("jetstream_node_killed", "scale",
             "SIGKILL one server of the 3-server JetStream cluster (streams R3): ingest goes "
             "on; no batch lost, no sample lost or duplicated", jetstream_node_killed),
    # last: a sample it loses stays lost, and the scenarios account cumulatively
    Scenario("replica_killed_series_backlog", "scale",
             "the series store stalls while 2 agents publish, then the leading replica is "
             "SIGKILLed: the other leads within 5 s; no batch lost, no sample lost or "
             "duplicated in the series store once it is back", replica_killed_series_backlog),
)
