"""The training rig's chaos scenarios (:class:`~forewarn.chaos.training_rig.TrainingRig`):
a rank killed, hung, a NaN loss, a gradient spike, a straggler, a corrupt checkpoint."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from forewarn.chaos.lab import Lab
from forewarn.chaos.outcome import Outcome
from forewarn.chaos.scenario_tools import (
    first_finding,
    rounded,
)
from forewarn.chaos.training_rig import TRAIN_JOB, TrainingRig
from forewarn.spawn.procs import wait_until

NODE1 = "chaos-node-1"



def _is_rank(rank: int) -> Callable[[dict[str, Any]], bool]:
    def m(f: dict[str, Any]) -> bool:
        s = f.get("subject", {})
        return bool(s.get("job") == TRAIN_JOB and s.get("rank") == rank)
    return m


def _job_f(f: dict[str, Any]) -> bool:
    return bool(f.get("subject", {}).get("job") == TRAIN_JOB)


def _restart_report(lab: Lab, out: Outcome, attempt: int, failure_step: int,
                    expect_step: int | None) -> int | None:
    """Wait for the job to come back after ``attempt``; check it resumed from
    ``expect_step`` on both ranks; record the loss. Returns the resumed step."""
    tr = lab.training()
    got = tr.resumed(attempt)
    if not out.expect(got is not None,
                      f"the job did not restart on both ranks\n{tr.diagnosis()}"):
        return None
    assert got is not None
    steps = {r: int(e.get("step", 0)) for r, e in got.items()}
    resumed = min(steps.values())
    out.expect(len(set(steps.values())) == 1, f"ranks resumed from different steps {steps}")
    if expect_step is not None:
        out.expect(resumed == expect_step, f"resumed from step {resumed}, expected the "
                   f"newest good checkpoint, step {expect_step}")
    lost = failure_step - resumed
    out.figures.update(failure_step=failure_step, resumed_step=resumed, steps_lost=lost)
    out.lost = (f"{lost} steps (failure at step {failure_step}, resumed from checkpoint "
                f"{resumed})")
    return resumed


def rank_killed(lab: Lab, out: Outcome) -> None:
    tr = lab.training()
    o = lab.options
    attempt = tr.ready(new_steps=o.checkpoint_every + 5)
    newest = max(tr.complete_checkpoints(), default=None)
    failure_step = tr.last_step(1) or 0
    t0 = time.time()
    tr.signal_rank(1, signal.SIGKILL)
    f = first_finding(lab, NODE1, "rank_gone", t0, 30, _is_rank(1))
    if out.expect(f is not None, "no rank_gone finding for rank 1"):
        assert f is not None
        out.detection_s = rounded(float(f["time"]) - t0)
        out.detected = f"rank_gone {f['health']}: {f['reason']}"
    newest = max([s for s in tr.complete_checkpoints() if s <= failure_step + 1],
                 default=newest)
    out.action = "torchrun (--max-restarts) restarted the job from its newest checkpoint"
    _restart_report(lab, out, attempt, failure_step, newest)


def _inject(tr: TrainingRig, out: Outcome, what: str, rank: int, kind: str,
            **params: float) -> dict[str, Any] | None:
    """Inject a fault into ``rank`` and wait until the training program applied it (its
    ``fault`` event); None, with the problem recorded, when it never did."""
    applied: dict[str, Any] | None = tr.fault_applied(tr.inject(rank, kind, **params))
    out.expect(applied is not None, f"the {what} was not applied")
    return applied


def rank_hung(lab: Lab, out: Outcome) -> None:
    tr = lab.training()
    attempt = tr.ready(new_steps=30)
    applied = _inject(tr, out, "hang", 0, "hang")
    if applied is None:
        return
    t0 = float(applied["time"])
    hang_step = int(applied["step"]) - 1
    f = first_finding(lab, NODE1, "rank_hang", t0, 60, _job_f, health=("unhealthy",))
    if out.expect(f is not None, "no rank_hang finding"):
        assert f is not None
        out.detection_s = rounded(float(f["time"]) - t0)
        ev = f.get("evidence", {})
        out.detected = f"rank_hang unhealthy: {f['reason']}"
        out.figures["hang_timeout_s"] = ev.get("timeout_s")
        out.figures["nccl_timeout_s"] = 600
    exits = wait_until(lambda: [e for e in tr.select("rank_exit", attempt=attempt)], 60)
    if out.expect(bool(exits), "the hung job's ranks were not ended"):
        assert exits
        # The agent ends them (hang_action = terminate): the harness sent no signal.
        out.action = ("agent ended the hung job's ranks (SIGTERM, SIGKILL after grace); "
                      f"exit codes {sorted({int(e['code']) for e in exits})}; torchrun "
                      "restarted it from its newest checkpoint")
        out.figures["ended_after_s"] = rounded(float(exits[0]["time"]) - t0)
    newest = max([s for s in tr.complete_checkpoints() if s <= hang_step], default=None)
    _restart_report(lab, out, attempt, hang_step, newest)


def nan_loss(lab: Lab, out: Outcome) -> None:
    tr = lab.training()
    attempt = tr.ready(new_steps=10)
    applied = _inject(tr, out, "NaN", 1, "nan")
    if applied is None:
        return
    nan_step = int(applied["step"])
    step_ev = wait_until(lambda: tr.select("step", rank=1, step=nan_step, attempt=attempt), 20)
    t0 = float(step_ev[0]["time"]) if step_ev else float(applied["time"])
    f = first_finding(lab, NODE1, "nan_loss", t0 - 1, 30, _is_rank(1), health=("unhealthy",))
    if out.expect(f is not None, "no nan_loss finding for rank 1"):
        assert f is not None
        bad = f.get("evidence", {}).get("bad_step")
        out.detection_s = rounded(max(0.0, float(f["time"]) - t0))
        out.detected = f"nan_loss unhealthy at step {bad} (NaN at step {nan_step})"
        out.figures.update(nan_step=nan_step, reported_step=bad)
        out.expect(bad == nan_step, f"NaN reported at step {bad}, injected at {nan_step}")
        out.action = (f"suggested {f.get('action')}: the job (its launcher, here the chaos "
                      "harness) restarts from the last checkpoint before the NaN")
    failure_step = tr.last_step(1) or nan_step
    tr.signal_rank(1, signal.SIGKILL)
    before = max([s for s in tr.complete_checkpoints() if s < nan_step], default=None)
    resumed = _restart_report(lab, out, attempt, failure_step, before)
    if resumed is not None:
        out.expect(resumed < nan_step, f"resumed from step {resumed}, not before the NaN "
                   f"at {nan_step}")
        ok = wait_until(lambda: [e for e in tr.select("step", rank=1)
                                 if int(e.get("attempt", 0)) > attempt and e.get("loss")
                                 is not None], 60)
        out.expect(bool(ok), "no finite loss after the rollback")


def grad_explosion(lab: Lab, out: Outcome) -> None:
    tr = lab.training()
    attempt = tr.ready(new_steps=20)

    def local_orders() -> float:
        return tr.agent.metric("forewarn_checkpoint_orders_total", training_job=TRAIN_JOB,
                               reason="grad_spike") or 0.0

    local0 = local_orders()
    applied = _inject(tr, out, "gradient explosion", 1, "grad", factor=1000.0)
    if applied is None:
        return
    k = int(applied["step"])
    step_ev = wait_until(lambda: tr.select("step", rank=1, step=k, attempt=attempt), 20)
    t0 = float(step_ev[0]["time"]) if step_ev else float(applied["time"])
    f = first_finding(lab, NODE1, "grad_spike", t0 - 1, 30, _job_f, health=("unhealthy",))
    if out.expect(f is not None, "no grad_spike finding"):
        assert f is not None
        ev = f.get("evidence", {})
        out.detection_s = rounded(max(0.0, float(f["time"]) - t0))
        out.detected = (f"grad_spike at step {ev.get('bad_step')}: {ev.get('ratio')}x the "
                        "rolling median")
        out.expect(ev.get("bad_step") == k, f"spike reported at step {ev.get('bad_step')}, "
                   f"injected at {k}")
    fast = wait_until(lambda: local_orders() > local0, 10)
    out.expect(fast is not None, "the agent did not order a checkpoint on its own (fast path)")
    saved = wait_until(lambda: _ordered_after(tr, k, attempt), 30)
    if out.expect(bool(saved), "no ordered checkpoint saved by both ranks after the spike"):
        log = lab.main_collector().get("/api/v1/commands/log?limit=200")
        central = [(r["command"]["order"]["step"], float(r["created"])) for r in log
                   if r.get("kind") == "checkpoint" and float(r.get("created", 0)) >= t0 - 1
                   and (r.get("command") or {}).get("order", {}).get("job") == TRAIN_JOB]
        by_collector = any(step == saved for step, _t in central)
        out.action = (f"the agent ordered a checkpoint on its own (fast path); both ranks saved "
                      f"step {saved}" + (" — the step of the collector's later order for the "
                                         "same finding, which superseded the agent's nearer "
                                         "one" if by_collector else ""))
        out.figures.update(ordered_step=saved, spike_step=k, fast_path_order=fast is not None,
                           saved_step_from="collector" if by_collector else "agent")
    out.expect(tr.launcher.attempt == attempt, "the job restarted")
    out.lost = "0 steps (training went on; the newest finite state was saved)"
    out.figures["steps_lost"] = 0


def _ordered_after(tr: Any, k: int, attempt: int) -> int | None:
    by_step: dict[int, set[int]] = {}
    for e in tr.select("checkpoint", attempt=attempt):
        if e.get("ordered") and int(e["step"]) >= k:
            by_step.setdefault(int(e["step"]), set()).add(int(e["rank"]))
    both = [s for s, r in by_step.items() if r == {0, 1}]
    return min(both) if both else None


def straggler(lab: Lab, out: Outcome) -> None:
    tr = lab.training()
    o = lab.options
    attempt = tr.ready(new_steps=20)
    applied = _inject(tr, out, "slowdown", 1, "slow", seconds=3 * o.step_seconds + 0.05)
    if applied is None:
        return
    t0 = float(applied["time"])
    f = first_finding(lab, NODE1, "straggler", t0, 60, _is_rank(1))
    tr.inject(1, "slow", seconds=0.0)
    if out.expect(f is not None, "no straggler finding for rank 1"):
        assert f is not None
        out.detection_s = rounded(float(f["time"]) - t0)
        out.detected = f"straggler {f['health']}: {f['reason']}"
        out.action = f"suggested {f.get('action')} (the collector compares across nodes)"
    ok = tr.ready(new_steps=10)
    out.expect(ok == attempt, "the job restarted")
    out.lost = "0 steps (slower steps while it lasted; the job went on)"
    out.figures["steps_lost"] = 0


def corrupt_checkpoint(lab: Lab, out: Outcome) -> None:
    tr = lab.training()
    o = lab.options

    def two_good() -> bool:
        return len([s for s in tr.complete_checkpoints()
                    if (tr.ckpt / f"step-{s:09d}").is_dir()]) >= 2

    attempt = tr.ready(new_steps=5)
    if not out.expect(wait_until(two_good, 60 + 4 * o.checkpoint_every * o.step_seconds)
                      is not None, "fewer than two checkpoints on disk"):
        return
    # Right after a checkpoint lands, so no newer one appears before the crash.
    n0 = len(tr.select("checkpoint", rank=0))
    wait_until(lambda: len(tr.select("checkpoint", rank=0)) > n0 and
               len(tr.complete_checkpoints()) > 0 and two_good(), 60)
    on_disk = sorted(int(p.name.split("-")[1]) for p in tr.ckpt.glob("step-*") if p.is_dir())
    newest, previous = on_disk[-1], on_disk[-2]
    victim = max((p for p in (tr.ckpt / f"step-{newest:09d}").iterdir()
                  if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
        data[i] ^= 0xFF
    victim.write_bytes(bytes(data))
    failure_step = tr.last_step(0) or newest
    tr.signal_rank(0, signal.SIGKILL)
    t_kill = time.time()
    out.figures.update(corrupted=f"{victim.parent.name}/{victim.name}", newest=newest,
                       previous_good=previous)
    resumed = _restart_report(lab, out, attempt, failure_step, previous)
    got = tr.resumed(attempt, timeout=1) or {}
    skipped = [s for e in got.values() for s in e.get("skipped", [])]
    if out.expect(any(f"step-{newest:09d}" in s[0] for s in skipped),
                  f"the corrupt checkpoint {newest} was not reported skipped: {skipped}"):
        reason = next(s[1] for s in skipped if f"step-{newest:09d}" in s[0])
        out.detected = f"on load: step {newest} skipped ({reason})"
        first = min(float(e["time"]) for e in got.values())
        out.detection_s = rounded(first - t_kill)
    if resumed is not None:
        out.action = f"loaded the previous good checkpoint, step {resumed}"
