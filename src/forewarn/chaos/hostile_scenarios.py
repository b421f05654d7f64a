"""The telemetry rig's chaos scenarios of hostile input: a scenario's own client
posts what a broken or hostile agent would (poison, an impostor, a skewed clock, slowloris,
an alert storm), with a token of its own node on the rig's collector, beside the rig's
real agent, whose data is then accounted as in the telemetry scenarios: one bad input
must cost nobody else anything."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from forewarn.chaos.exposition import fetch, samples, total
from forewarn.chaos.lab import Lab
from forewarn.chaos.outcome import Outcome
from forewarn.chaos.scenario_tools import (
    batch_record,
    finish_telemetry,
    more_batches,
    new_parquet,
    post_batch,
    rounded,
    sample_record,
    settle,
)
from forewarn.chaos.telemetry_rig import TelemetryRig
from forewarn.spawn import workload
from forewarn.spawn.procs import wait_until

POISONS: tuple[tuple[str, str, Any], ...] = (
    ("+Inf power", "power_w", float("inf")),
    ("millisecond timestamp", "time", None),  # filled in with now * 1000
    ("NVML 2^64-1 sentinel", "ecc_corrected_volatile", 2**64 - 1),
)


def poisoned_sample(lab: Lab, out: Outcome) -> None:
    poisoner = "chaos-poisoner"
    rig = lab.telemetry("poisoned", others=(poisoner,))
    rig.storing()
    answers = []
    t0 = time.time()
    for seq, (what, fieldname, value) in enumerate(POISONS):
        now = time.time()
        bad = sample_record(poisoner, 1, now, **{fieldname: now * 1000 if value is None else value})
        status, text = post_batch(rig, poisoner, batch_record(poisoner, "chaos-poisoner-agent", seq,
                                                   [sample_record(poisoner, 0, now), bad]))
        answers.append((what, status, text[:300]))
        named = f"samples[1].{fieldname}" in text
        out.expect((status == 200 and '"refused"' in text and named)
                   or (400 <= status < 500 and named),
                   f"{what}: answered {status} {text[:200]!r}, expected a refusal naming "
                   f"$.samples[1].{fieldname}")
    refused = rig.collector.metric("forewarn_collector_ingest_refused_records_total") or 0.0
    rejected = rig.collector.metric("forewarn_collector_ingest_rejected_total") or 0.0
    out.expect(refused + rejected >= len(POISONS),
               f"{int(refused + rejected)} refusals counted for {len(POISONS)} poisons")
    flushed = new_parquet(rig, time.time() + 0.1)
    out.expect(flushed, "no Parquet file was written after the poisoned batches (flush "
               "wedged)")
    flush_errors = rig.collector.metric("forewarn_collector_telemetry_flush_errors_total")
    out.expect(not flush_errors, f"{flush_errors} failed flushes after the poison")
    out.detected = ("collector: " + "; ".join(f"{w} -> {s}" for w, s, _ in answers)
                    + f"; {int(refused)} records refused, {int(rejected)} batches rejected "
                    "(metrics)")
    out.detection_s = rounded(time.time() - t0)
    out.action = "the poisoned rows were refused by field; the next flushes wrote Parquet"
    out.figures.update(poisons=len(POISONS), refused_records=int(refused),
                       rejected_batches=int(rejected), flush_errors=int(flush_errors or 0),
                       flushed_after=flushed, answers=[f"{w}: {s}" for w, s, _ in answers])
    more_batches(rig)
    finish_telemetry(lab, rig, out, excused=[])
    out.lost += " of the real agent; only the poisoned rows were refused"


def impostor_agent(lab: Lab, out: Outcome) -> None:
    impostor = "chaos-intruder"
    rig = lab.telemetry("impostor", others=(impostor,))
    rig.storing()
    state = rig.agent.spool_state()
    victim_id, next_seq = str(state["agent_id"]), int(state["next_seq"])
    # The impostor claims the victim's next seqs: stored, they would make the victim's
    # real batches with those seqs look like duplicates.
    n_forged = 20
    statuses = []
    t0 = time.time()
    for seq in range(next_seq, next_seq + n_forged):
        status, text = post_batch(rig, impostor, batch_record(
            impostor, victim_id, seq, [sample_record(impostor, 0, time.time())]))
        statuses.append(status)
    out.figures["last_answer"] = text[:300]
    forbidden = statuses.count(403)
    out.expect(forbidden == n_forged, f"{forbidden} of {n_forged} forged batches refused "
               f"with 403 (answers {sorted(set(statuses))})")
    mismatch = rig.collector.metric("forewarn_collector_ingest_rejected_total",
                                    reason="identity_mismatch") or 0.0
    out.detected = (f"collector: {forbidden}/{n_forged} batches under another node's "
                    f"agent_id refused 403; {int(mismatch)} counted identity_mismatch")
    out.detection_s = rounded(time.time() - t0)
    out.action = "forged batches refused; the victim's real batches (same seqs) stored"
    out.figures.update(forged=n_forged, refused_403=forbidden,
                       identity_mismatch_counted=int(mismatch), forged_seqs=
                       f"{next_seq}-{next_seq + n_forged - 1}")
    # the victim must get past every forged seq
    wait_until(lambda: int(rig.agent.spool_state()["next_seq"]) > next_seq + n_forged + 2,
               60, step=0.5)
    finish_telemetry(lab, rig, out, excused=[])


SKEW_S = 3600.0
"""The skewed agent's clock is this far ahead (an hour: beyond ingest_max_future_s)."""


def clock_skew(lab: Lab, out: Outcome) -> None:
    """The agent's clock is not injectable: this client posts what an agent whose clock is
    an hour ahead would (its Forewarn-Sent-At header and its sample times), then what it
    posts once its clock is fixed."""
    skewed = "chaos-skewed"
    rig = lab.telemetry("clock-skew", others=(skewed,))
    rig.storing()
    now = time.time()
    t0 = now
    status, text = post_batch(rig, skewed, batch_record(
        skewed, "chaos-skewed-agent", 0, [sample_record(skewed, g, now + SKEW_S) for g in (0, 1)],
        created=now + SKEW_S), headers={"Forewarn-Sent-At": f"{now + SKEW_S:.3f}"})
    refused_future = (status == 200 and text.count('"time"') >= 2) or 400 <= status < 500
    out.expect(refused_future, f"future samples answered {status} {text[:200]!r}, expected "
               "them refused (reason time)")
    skew = rig.collector.metric("forewarn_collector_agent_clock_skew_seconds", node=skewed)
    out.expect(skew is not None and abs(skew - SKEW_S) < 30,
               f"clock skew of {skewed} reported as {skew}, expected about {SKEW_S:g} s")
    # The clock is fixed: its rows must follow real time, not stay frozen an hour ahead.
    fixed = time.time()
    s2, t2 = post_batch(rig, skewed, batch_record(
        skewed, "chaos-skewed-agent", 1, [sample_record(skewed, g, fixed) for g in (0, 1)]),
        headers={"Forewarn-Sent-At": f"{fixed:.3f}"})
    out.expect(s2 == 200 and '"refused"' not in t2, f"the fixed clock's batch answered {s2} "
               f"{t2[:200]!r}")

    def latest(node: str) -> dict[int, float]:
        rows = rig.collector.get(f"/api/v1/gpus?node={node}")
        return {int(r["gpu"]): float(r.get("time") or r.get("last_seen") or 0) for r in rows}

    mine = wait_until(lambda: latest(skewed) if len(latest(skewed)) == 2 else None, 10) or {}
    out.expect(bool(mine) and all(abs(t - fixed) < 5 for t in mine.values()),
               f"{skewed}'s GPU rows at {mine}, expected the fixed clock's {fixed:.1f}")
    time.sleep(2.0)
    real = latest(rig.node)
    lag = max((time.time() - t for t in real.values()), default=None)
    out.expect(lag is not None and len(real) == rig.gpus and lag < 5,
               f"the real agent's GPU rows lag {lag} s ({len(real)} rows)")
    out.detected = (f"collector: skew of {skewed} = {skew} s (metric); its future samples "
                    f"answered {status}")
    out.detection_s = rounded(time.time() - t0)
    out.action = "future samples refused; the rows follow the agent once its clock is fixed"
    out.figures.update(skew_set_s=SKEW_S, skew_reported_s=rounded(skew), future_answer=status,
                       real_rows_lag_s=rounded(lag))
    finish_telemetry(lab, rig, out, excused=[])


class _Slowloris:
    """Hold ``n`` sockets to ``port`` for ``seconds`` (ends by itself): even ones silent,
    odd ones dripping a request head a byte a second; one the server closed is opened
    again."""

    HEAD = b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nX-Slow: "

    def __init__(self, port: int, n: int, seconds: float) -> None:
        import threading

        self.port, self.n, self.seconds = port, n, seconds
        self.opened = self.reopened = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-slowloris", daemon=True)

    def _open(self) -> Any:
        import socket

        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        except OSError:
            return None
        self.opened += 1
        return s

    def _run(self) -> None:
        socks = [self._open() for _ in range(self.n)]
        sent = [0] * self.n
        end = time.monotonic() + self.seconds
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                for i, s in enumerate(socks):
                    ok = s is not None
                    if ok and i % 2:
                        try:
                            s.send(self.HEAD[sent[i] % len(self.HEAD):][:1] or b"a")
                            sent[i] += 1
                        except OSError:
                            ok = False
                    if not ok:
                        if s is not None:
                            s.close()
                        socks[i], sent[i] = self._open(), 0
                        self.reopened += 1
                self._stop.wait(1.0)
        finally:
            for s in socks:
                if s is not None:
                    s.close()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)


SLOWLORIS_SOCKETS = 1100
SLOWLORIS_NOFILE = 1024
"""The collector gets the descriptor limit a service gets by default."""


def _log_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def _late_batches(rig: TelemetryRig, after_s: float) -> tuple[int, int]:
    """(batches received, batches received more than ``after_s`` after they were sealed)
    by the rig's collector so far (its ingest lag histogram)."""
    text = fetch(rig.collector.url + "/metrics", timeout=5)  # one scrape: the two agree
    name = "forewarn_collector_ingest_lag_seconds"
    total_n = int(total(text, f"{name}_count") or 0)
    in_time = sum(value for labels, value in samples(text, f"{name}_bucket")
                  if float(labels.get("le", "nan")) == after_s)
    return total_n, total_n - int(in_time)


SLOWLORIS_LATE_S = 5.0
"""An agent's batch must be stored within this long of being sealed, attack or not."""


def slowloris(lab: Lab, out: Outcome) -> None:
    import resource

    rig = lab.telemetry("slowloris")
    resource.prlimit(rig.collector.pid, resource.RLIMIT_NOFILE,
                     (SLOWLORIS_NOFILE, SLOWLORIS_NOFILE))
    rig.storing()
    lines0 = _log_lines(rig.collector.log)
    total0, late0 = _late_batches(rig, SLOWLORIS_LATE_S)
    attack_s = 20.0
    attack = _Slowloris(rig.collector.port, SLOWLORIS_SOCKETS, attack_s)
    attack.thread.start()
    t0 = time.time()
    # An operator's reads go straight to the collector (the agent's pushes through the
    # rig's proxy): the longest time none succeeded is a figure, not a criterion.
    last_read, read_stall, peak = t0, 0.0, 0.0
    while attack.thread.is_alive() and time.time() - t0 < attack_s + 10:
        with contextlib.suppress(OSError):
            rig.stored_batches()
            last_read = time.time()
        read_stall = max(read_stall, time.time() - last_read)
        with contextlib.suppress(OSError):
            peak = max(peak, rig.agent.metric("forewarn_uplink_spool_batches") or 0.0)
        time.sleep(0.25)
    attack.stop()
    settle(rig, out, "after the attack")
    total, late = _late_batches(rig, SLOWLORIS_LATE_S)
    during, late = total - total0, late - late0
    lines = _log_lines(rig.collector.log) - lines0
    alive = lab.procs.procs[rig.collector.name].poll() is None
    out.expect(alive, "the collector died under the attack")
    out.expect(during > 0 and late == 0, f"{late} of {during} batches stored more than "
               f"{SLOWLORIS_LATE_S:g} s after they were sealed")
    out.expect(lines <= 200, f"the collector logged {lines} lines during the attack")
    out.detected = (f"{attack.opened} attack sockets opened ({attack.reopened} reopened after "
                    f"the collector closed them); {during - late}/{during} batches stored "
                    f"within {SLOWLORIS_LATE_S:g} s; {lines} log lines")
    out.detection_s = None
    out.action = "idle sockets closed by the collector's timeouts; agents served"
    out.figures.update(attack_sockets=SLOWLORIS_SOCKETS, nofile=SLOWLORIS_NOFILE,
                       attack_s=attack_s, opened=attack.opened, reopened=attack.reopened,
                       batches_during=during, batches_late=late,
                       spool_peak_batches=int(peak), log_lines=lines,
                       api_read_stall_s=rounded(read_stall))
    finish_telemetry(lab, rig, out, excused=[])


ALERT_TOKEN = "chaos-alert-token-0123456789abcdef"
STORM_JOB = "chaos-storm-job"


def _storm_payload(start: int, n: int) -> dict[str, Any]:
    """An Alertmanager body of ``n`` firing alerts, each a label set of its own (nodes
    without jobs): a storm that deduplication cannot shrink."""
    alerts = [{"status": "firing", "annotations": {"summary": "hot"},
               "labels": {"alertname": f"Storm{i % 20}", "node": f"storm{i // 160}",
                          "gpu": str(i % 8), "instance": str(i), "severity": "warning"},
               "startsAt": "2026-01-01T00:00:00Z", "fingerprint": f"{i:016x}"}
              for i in range(start, start + n)]
    return {"version": "4", "status": "firing", "receiver": "forewarn", "groupLabels": {},
            "commonLabels": {}, "alerts": alerts}


def _storm(url: str, rate: float, seconds: float, answers: list[int],
           per_post: int = 20, threads: int = 4) -> Any:
    """Post ``rate`` alerts/s for ``seconds`` from ``threads`` threads; returns them
    started."""
    import threading

    import httpx

    end = time.monotonic() + seconds
    interval = per_post * threads / rate

    def run(k: int) -> None:
        with httpx.Client(base_url=url, timeout=30, headers={
                "authorization": f"Bearer {ALERT_TOKEN}"}) as client:
            i, nxt = k * 10**6, time.monotonic()
            while time.monotonic() < end:
                try:
                    r = client.post("/api/v1/alerts/alertmanager",
                                    json=_storm_payload(i, per_post))
                    answers.append(r.status_code)
                except httpx.HTTPError:
                    answers.append(0)
                i += per_post
                nxt += interval
                time.sleep(max(0.0, nxt - time.monotonic()))

    ts = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for t in ts:
        t.start()
    return ts


def alert_storm_with_fatal(lab: Lab, out: Outcome) -> None:
    from forewarn.demo.launch import python_module

    rig = lab.telemetry("alert-storm", collector_extra=f'alert_token = "{ALERT_TOKEN}"\n')
    job_log = rig.agent.dir / "storm-job.jsonl"
    lab.procs.spawn("alert-storm-job", python_module(
        workload.__name__, "light", "--job", STORM_JOB, "--gpu", "1", "--socket",
        rig.agent.socket, "--checkpoint-dir", str(rig.agent.dir / "storm-ckpt")), job_log)
    known = wait_until(lambda: any(j.get("job") == STORM_JOB
                                   for j in rig.collector.get("/api/v1/jobs")), 60, step=0.5)
    if not out.expect(known is not None, f"the collector never saw job {STORM_JOB}"):
        return
    rate, storm_s = 1000.0, 20.0
    answers: list[int] = []
    threads = _storm(rig.collector.url, rate, storm_s, answers)
    t_storm = time.time()
    time.sleep(storm_s / 2)
    during = len(answers)
    t_fault = time.time()
    # what the agent sends when a GPU falls off the bus (XID 79): an urgent finding
    fatal = {"check": "gpu_lost", "health": "unhealthy", "action": "reset_gpu",
             "time": t_fault, "reason": "GPU fell off the bus (XID 79)",
             "subject": {"kind": "gpu", "node": rig.node, "gpu": 1}}
    status, text = post_batch(rig, rig.node, batch_record(rig.node, "chaos-storm-fault", 0, [],
                                                urgent=True, findings=[fatal]))
    out.expect(status == 200, f"the fatal finding answered {status} {text[:200]!r}")

    def ordered() -> float | None:
        log = rig.collector.get("/api/v1/commands/log?limit=1000")
        ts = [float(r["created"]) for r in log if r.get("kind") == "checkpoint"
              and float(r.get("created", 0)) >= t_fault - 0.5
              and (r.get("command") or {}).get("order", {}).get("job") == STORM_JOB]
        return min(ts) if ts else None

    t_order = wait_until(ordered, 30, step=0.05)
    for t in threads:
        t.join(60)
    sent = len(answers) * 20
    latency = None if t_order is None else t_order - t_fault
    out.expect(latency is not None and latency <= 1.0,
               f"checkpoint ordered {latency} s after the fatal finding (bound 1 s)")
    out.expect(bool(answers) and all(a in (200, 202, 429) for a in answers),
               f"alert answers {sorted(set(answers))}")
    out.detected = (f"collector: gpu_lost unhealthy on {rig.node} GPU 1 during a storm of "
                    f"{sent / max(1e-9, time.time() - t_storm):.0f} alerts/s")
    out.detection_s = rounded(latency)
    out.action = f"checkpoint ordered for {STORM_JOB} {latency and round(latency, 3)} s after "\
        "the fault"
    out.figures.update(alerts_sent=sent, storm_s=storm_s, posts_before_fault=during,
                       order_latency_s=rounded(latency, 3),
                       alert_answers={str(a): answers.count(a) for a in set(answers)})
    finish_telemetry(lab, rig, out, excused=[])
