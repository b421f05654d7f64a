"""The chaos scenarios: each injects one fault into the real stack of the
:class:`~forewarn.chaos.lab.Lab`, states what must happen, and checks it.

Every scenario returns an :class:`Outcome`: what was detected (which check, on what),
how fast (seconds from the fault to the finding, by the agent's own finding time), what
action ran, and what was lost (telemetry: batches and samples, which must be none;
training: steps since the checkpoint the job resumed from). ``passed`` is the check of
the stated expectation; ``problems`` says what did not hold.

The registry :data:`SCENARIOS` is an explicit list, in the order they run.
"""

from __future__ import annotations

import contextlib
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forewarn.chaos.accounting import Account, account
from forewarn.chaos.lab import HW_FAULTS, TRAIN_JOB, HardwareRig, Lab, TelemetryRig, TrainingRig
from forewarn.chaos.outcome import Outcome, Scenario
from forewarn.chaos.procs import wait_until
from forewarn.chaos.scale_scenarios import SCALE_SCENARIOS

__all__ = ["SCENARIOS", "Outcome", "Scenario", "by_name"]


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


# --------------------------------------------------------------------------- training

NODE1 = "chaos-node-1"


def _first_finding(lab: Lab, node: str, check: str, since: float, timeout: float,
                   match: Callable[[dict[str, Any]], bool] = lambda f: True,
                   health: tuple[str, ...] = ("unhealthy", "degraded")
                   ) -> dict[str, Any] | None:
    """The collector's first stored ``check`` finding on ``node`` at or after ``since``
    with one of ``health`` that ``match`` accepts (the finding body, with its row time)."""
    c = lab.main_collector()

    def look() -> dict[str, Any] | None:
        for row in c.findings(node, check, since):
            f = row.get("finding") or {}
            if f.get("health") in health and match(f):
                return dict(f)
        return None

    got: dict[str, Any] | None = wait_until(look, timeout, step=0.2)
    return got


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
    if not out.expect(got is not None, "the job did not restart on both ranks"):
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
    f = _first_finding(lab, NODE1, "rank_gone", t0, 30, _is_rank(1))
    if out.expect(f is not None, "no rank_gone finding for rank 1"):
        assert f is not None
        out.detection_s = _r(float(f["time"]) - t0)
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
    f = _first_finding(lab, NODE1, "rank_hang", t0, 60, _job_f, health=("unhealthy",))
    if out.expect(f is not None, "no rank_hang finding"):
        assert f is not None
        out.detection_s = _r(float(f["time"]) - t0)
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
        out.figures["ended_after_s"] = _r(float(exits[0]["time"]) - t0)
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
    f = _first_finding(lab, NODE1, "nan_loss", t0 - 1, 30, _is_rank(1), health=("unhealthy",))
    if out.expect(f is not None, "no nan_loss finding for rank 1"):
        assert f is not None
        bad = f.get("evidence", {}).get("bad_step")
        out.detection_s = _r(max(0.0, float(f["time"]) - t0))
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
    f = _first_finding(lab, NODE1, "grad_spike", t0 - 1, 30, _job_f, health=("unhealthy",))
    if out.expect(f is not None, "no grad_spike finding"):
        assert f is not None
        ev = f.get("evidence", {})
        out.detection_s = _r(max(0.0, float(f["time"]) - t0))
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
    f = _first_finding(lab, NODE1, "straggler", t0, 60, _is_rank(1))
    tr.inject(1, "slow", seconds=0.0)
    if out.expect(f is not None, "no straggler finding for rank 1"):
        assert f is not None
        out.detection_s = _r(float(f["time"]) - t0)
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
        out.detection_s = _r(first - t_kill)
    if resumed is not None:
        out.action = f"loaded the previous good checkpoint, step {resumed}"


# --------------------------------------------------------------------------- hardware

NODE2 = HardwareRig.NODE


def _xid_time(lab: Lab, code: int, gpu: int) -> float | None:
    rows = lab.main_collector().get(f"/api/v1/xids?node={NODE2}&code={code}")
    times = [float(r["time"]) for r in rows if r.get("gpu") == gpu]
    return min(times) if times else None


def _gpu_match(gpu: int) -> Callable[[dict[str, Any]], bool]:
    def m(f: dict[str, Any]) -> bool:
        return bool(f.get("subject", {}).get("gpu") == gpu
                    and not f.get("subject", {}).get("job"))
    return m


def _hardware(lab: Lab, out: Outcome, gpu: int, xid: int, terminal_checks: tuple[str, ...],
              precursor_checks: tuple[str, ...], max_loss_s: float | None = None) -> None:
    hw = lab.hardware()
    o = lab.options
    t_end = wait_until(lambda: _xid_time(lab, xid, gpu), hw.agent.started + o.hw_window_s +
                       60 - time.time(), step=0.5)
    if not out.expect(t_end is not None, f"no XID {xid} on GPU {gpu} reached the collector"):
        return
    assert t_end is not None
    terminal = None
    for check in terminal_checks:
        terminal = _first_finding(lab, NODE2, check, t_end - 1, 20, _gpu_match(gpu),
                                  health=("unhealthy",))
        if terminal is not None:
            break
    if out.expect(terminal is not None, f"no unhealthy {'/'.join(terminal_checks)} finding "
                  f"on GPU {gpu} after XID {xid}"):
        assert terminal is not None
        out.detection_s = _r(max(0.0, float(terminal["time"]) - t_end))
        out.detected = f"{terminal['check']} unhealthy: {terminal['reason'][:120]}"
    _precursor_and_orders(lab, out, hw, gpu, t_end, precursor_checks, max_loss_s)


def _precursor_and_orders(lab: Lab, out: Outcome, hw: HardwareRig, gpu: int, t_end: float,
                          precursor_checks: tuple[str, ...], max_loss_s: float | None) -> None:
    pre = [f for check in precursor_checks
           for f in [_first_finding(lab, NODE2, check, 0, 0.1, _gpu_match(gpu))] if f]
    first_pre = min(pre, key=lambda f: float(f["time"])) if pre else None
    if out.expect(first_pre is not None and float(first_pre["time"]) < t_end,
                  f"no precursor finding ({'/'.join(precursor_checks)}) before the failure"):
        assert first_pre is not None
        lead = t_end - float(first_pre["time"])
        out.figures["precursor"] = f"{first_pre['check']} {first_pre['health']}"
        out.figures["precursor_lead_s"] = _r(lead)
    events = hw.events(gpu)
    at_end = max((int(e["step"]) for e in events
                  if e.get("event") == "step" and float(e["time"]) <= t_end), default=0)
    ordered = [e for e in events if e.get("event") == "checkpoint" and e.get("ordered")]
    before = [e for e in ordered if float(e["time"]) <= t_end]
    saved = max((int(e["step"]) for e in events if e.get("event") == "checkpoint"
                 and float(e["time"]) <= t_end), default=0)
    out.figures.update(step_at_failure=at_end, last_checkpoint_before=saved,
                       steps_lost=at_end - saved, progress_lost_pct=_r(
                           100.0 * (at_end - saved) / at_end if at_end else None, 1))
    if max_loss_s is not None:
        # The work lost is bounded: the newest save before the failure is at most
        # max_loss_s old (plus a few steps for the order's round trip).
        old = max((int(e["step"]) for e in events if e.get("event") == "step"
                   and float(e["time"]) <= t_end - max_loss_s), default=0)
        bound = at_end - old + LOSS_MARGIN_STEPS
        out.figures.update(max_loss_s=max_loss_s, steps_lost_bound=bound)
        out.expect(at_end - saved <= bound,
                   f"{at_end - saved} steps lost ({out.figures['progress_lost_pct']} % of the "
                   f"job's progress): the newest save before the failure is older than "
                   f"{max_loss_s:g} s (bound {bound} steps)")
    out.lost = (f"{at_end - saved} steps of job {hw.job(gpu)} (step {at_end} at the failure, "
                f"checkpoint {saved}); telemetry: see the telemetry scenarios")
    if out.expect(bool(before), f"no checkpoint was ordered for job {hw.job(gpu)} before "
                  "the failure"):
        first = before[0]
        out.action = (f"checkpoint ordered, saved at step {first['step']} "
                      f"{t_end - float(first['time']):.1f} s before the failure"
                      + (f" ({len(before)} ordered saves before it, the last at step "
                         f"{before[-1]['step']})" if len(before) > 1 else ""))
        out.figures["order_lead_s"] = _r(t_end - float(first["time"]))
        out.figures["ordered_before"] = len(before)


def ecc_storm_dbe(lab: Lab, out: Outcome) -> None:
    _hardware(lab, out, HW_FAULTS.index("ecc_storm"), 48, ("ecc", "xid"), ("ecc", "xid"))


def xid79_off_bus(lab: Lab, out: Outcome) -> None:
    _hardware(lab, out, HW_FAULTS.index("pcie_replay"), 79, ("gpu_lost", "xid"), ("pcie",))


LOSS_MARGIN_STEPS = 5
REMAP_MAX_LOSS_S = 10.0
"""Wall seconds (50 s simulated) of work the row-remap failure may cost: remaps keep
growing for two minutes (simulated) before the failure, so the risk is known all along."""


def row_remap_failure(lab: Lab, out: Outcome) -> None:
    _hardware(lab, out, HW_FAULTS.index("remap_growth"), 64, ("remap", "xid"),
              ("remap", "xid"), max_loss_s=REMAP_MAX_LOSS_S)


def thermal_runaway(lab: Lab, out: Outcome) -> None:
    """No XID ends a thermal runaway: the event is the slowdown margin falling under
    5 °C (SW thermal slowdown starts), found from the scenario itself."""
    from forewarn.agent.sources.scenario import parse_scenario
    from forewarn.agent.sources.sim import SimBackend

    hw = lab.hardware()
    o = lab.options
    gpu = HW_FAULTS.index("thermal_runaway")
    # The sim clock's origin, exactly: XID 48 on GPU 0 is stamped at its scripted time.
    t48 = wait_until(lambda: _xid_time(lab, 48, HW_FAULTS.index("ecc_storm")),
                     hw.agent.started + o.hw_window_s + 60 - time.time(), step=0.5)
    if not out.expect(t48 is not None, "cannot place the sim clock (no XID 48 on GPU 0)"):
        return
    assert t48 is not None
    opened = t48 - (o.hw_fault_start_s + o.hw_fault_duration_s) / o.hw_sim_speed
    sim = SimBackend(parse_scenario(hw.scenario), node=NODE2, speed=o.hw_sim_speed,
                     clock=lambda: opened)
    sim.open()
    onset = hw_slow = None
    t = o.hw_fault_start_s
    while t < o.hw_fault_start_s + o.hw_fault_duration_s and hw_slow is None:
        s = sim.gpu_sample(gpu, t, sim.wall_time(t))
        margin = s.slowdown_margin_c if s.slowdown_margin_c is not None else 99.0
        if onset is None and margin < 5.0:
            onset = sim.wall_time(t)
        if margin <= 0.0:
            hw_slow = sim.wall_time(t)
        t += 0.1
    if not out.expect(onset is not None, "the scenario never brings the margin under 5 °C"):
        return
    assert onset is not None
    f = _first_finding(lab, NODE2, "thermal", 0, 30, _gpu_match(gpu))
    if out.expect(f is not None, f"no thermal finding on GPU {gpu}"):
        assert f is not None
        out.detection_s = _r(float(f["time"]) - onset)
        out.detected = f"thermal {f['health']}: {f['reason'][:120]}"
        out.action = f"suggested {f.get('action')}; the collector notifies (webhook)"
        out.expect(float(f["time"]) >= onset - 0.5, "thermal finding before the onset")
        if hw_slow is not None:
            out.figures["hw_slowdown_lead_s"] = _r(hw_slow - float(f["time"]))
    out.lost = "0 steps (the GPU throttles, the job slows, nothing dies)"
    events = hw.events(gpu)
    out.expect(any(e.get("event") == "step" and float(e["time"]) > (hw_slow or onset)
                   for e in events), "the job on the hot GPU stopped stepping")
    out.figures["steps_lost"] = 0


# --------------------------------------------------------------------------- telemetry

def _settle(rig: TelemetryRig, out: Outcome, what: str, timeout: float = 60.0) -> float | None:
    """Wait until the agent's spool is empty; returns how long that took."""
    t0 = time.time()
    ok = wait_until(rig.spool_empty, timeout, step=0.1)
    out.expect(ok is not None, f"the spool did not drain {what}")
    return _r(time.time() - t0) if ok else None


def _finish_telemetry(lab: Lab, rig: TelemetryRig, out: Outcome,
                      excused: list[tuple[float, float]], expect_drops: bool = False
                      ) -> Account:
    o = lab.options
    dropped = rig.agent.metric("forewarn_uplink_dropped_batches_total") or 0.0
    rig.agent.stop()  # gracefully: it seals what it holds and sends it
    # kill -9, not SIGTERM: what the collector acknowledged must be durable without a
    # graceful stop (that is what is being checked).
    rig.collector.kill9()
    acc = account(rig.agent.spool, rig.collector.data, node=rig.node,
                  allowed_gap_s=3 * o.telemetry_interval_s + 0.5, excused=excused)
    out.figures.update(acc.as_dict())
    out.figures.pop("excused_gaps")
    out.figures["gaps"] = len(acc.gaps)
    out.figures["dropped_counted"] = int(dropped)
    out.expect(acc.samples_in_batches == acc.samples_stored,
               f"{acc.samples_in_batches} samples in stored batches, {acc.samples_stored} in "
               "the telemetry history")
    out.expect(acc.duplicate_samples == 0, f"{acc.duplicate_samples} samples stored twice")
    out.expect(acc.spooled_left == 0, f"{acc.spooled_left} batches left in the spool")
    if expect_drops:
        out.expect(acc.lost_batches == int(dropped),
                   f"{acc.lost_batches} batches missing but {int(dropped)} counted as dropped")
        miss = acc.missing_seqs
        out.expect(not miss or miss == list(range(miss[0], miss[-1] + 1)),
                   "dropped batches are not one run of the oldest: "
                   f"{acc.as_dict()['missing_seqs']}")
        out.expect(not miss or miss[-1] < acc.produced_batches - 1,
                   "the newest batches were not kept")
        out.expect(not acc.gaps, f"sample gaps outside the overflow: {acc.gaps[:3]}")
        out.expect(dropped > 0, "the spool never overflowed (bound too large for the cut?)")
        out.lost = (f"{acc.lost_batches} of {acc.produced_batches} batches, every one "
                    f"counted in forewarn_uplink_dropped_batches_total")
    else:
        out.expect(acc.lost_batches == 0, f"batches lost: {acc.as_dict()['missing_seqs']}")
        out.expect(not acc.gaps, f"sample gaps over {3 * o.telemetry_interval_s + 0.5:.1f} s: "
                   f"{acc.gaps[:3]}")
        out.lost = (f"nothing: {acc.stored_batches}/{acc.produced_batches} batches, "
                    f"{acc.samples_stored} samples, each stored once")
    return acc


def agent_restart(lab: Lab, out: Outcome) -> None:
    o = lab.options
    rig = lab.telemetry("agent-kill")
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    t_kill = rig.agent.kill9()
    time.sleep(1.0)
    rig.agent.start()
    t_back = time.time()
    drained = _settle(rig, out, "after the restart")
    got = wait_until(lambda: rig.stored_batches(), 1)
    out.detected = ("collector: agent's batches resume after its restart; spool replayed "
                    f"{drained} s after the agent was back")
    out.detection_s = drained
    out.action = "agent restarted on the same spool (same agent_id, seq goes on), replayed"
    wait_until(lambda: rig.stored_batches() >= (got or 0) + 4, 30)
    acc = _finish_telemetry(lab, rig, out,
                            excused=[(t_kill - o.push_interval_s - 1.0, t_back + 1.0)])
    # What a kill -9 cannot save: samples polled but not yet sealed into a batch.
    before = [a for a, _b in acc.excused_gaps] if acc else []
    unsealed = _r(t_kill - max(before)) if before else None
    out.figures.update(unsealed_at_kill_s=unsealed, unsealed_bound_s=o.push_interval_s,
                       downtime_s=_r(t_back - t_kill))
    out.expect(unsealed is not None and unsealed <= o.push_interval_s + 0.5,
               f"{unsealed} s of samples before the kill are missing (bound "
               f"{o.push_interval_s} s + 0.5 s)")
    out.lost += (f"; the last {unsealed} s of samples before the kill -9 were polled but not "
                 f"yet sealed (bound: push_interval_s = {o.push_interval_s:g} s)")


def collector_restart(lab: Lab, out: Outcome) -> None:
    rig = lab.telemetry("collector-kill")
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    t_kill = rig.collector.kill9()
    grew = wait_until(lambda: (rig.agent.metric("forewarn_uplink_spool_batches") or 0) > 0, 20)
    out.expect(grew is not None, "the agent did not spool while the collector was down")
    time.sleep(1.5)
    rig.collector.start()
    t_back = time.time()
    drained = _settle(rig, out, "after the collector came back")
    out.detected = ("agent: push errors, batches held in the spool; replayed "
                    f"{drained} s after the collector was back")
    out.detection_s = drained
    out.action = "kill -9 collector, restarted on the same data; agent replayed its spool"
    out.figures["downtime_s"] = _r(t_back - t_kill)
    n = rig.stored_batches()
    wait_until(lambda: rig.stored_batches() >= n + 4, 30)
    _finish_telemetry(lab, rig, out, excused=[])


def _cut_off(lab: Lab, out: Outcome, name: str, cut_s: float) -> None:
    """Cut the agent off its collector at the proxy for ``cut_s``; nothing may be lost."""
    rig = lab.telemetry(name)
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    rig.proxy.cut()
    t_cut = time.time()
    errors0 = rig.agent.metric("forewarn_uplink_push_errors_total") or 0.0
    peak = 0.0
    while time.time() - t_cut < cut_s:
        peak = max(peak, rig.agent.metric("forewarn_uplink_spool_batches") or 0.0)
        time.sleep(min(1.0, cut_s / 10))
    errors = (rig.agent.metric("forewarn_uplink_push_errors_total") or 0.0) - errors0
    rig.proxy.restore()
    drained = _settle(rig, out, "after the cut ended", timeout=60 + cut_s)
    out.expect(peak > 0, "nothing was spooled during the cut")
    out.detected = (f"agent: {int(errors)} failed pushes, spool peaked at {int(peak)} batches; "
                    f"replayed {drained} s after the link came back")
    out.detection_s = drained
    out.action = f"spooled for {cut_s:g} s (network cut at a proxy), replayed in order"
    out.figures.update(cutoff_s=cut_s, spool_peak_batches=int(peak))
    n = rig.stored_batches()
    wait_until(lambda: rig.stored_batches() >= n + 4, 30)
    _finish_telemetry(lab, rig, out, excused=[])


def agent_cut_off(lab: Lab, out: Outcome) -> None:
    _cut_off(lab, out, "cut-off", lab.options.cutoff_s)


PARTITION_S = 60.0


def partition_60s(lab: Lab, out: Outcome) -> None:
    _cut_off(lab, out, "partition", PARTITION_S)


def nats_outage_60s(lab: Lab, out: Outcome) -> None:
    """All of NATS stopped for :data:`PARTITION_S`: the agent spools, then replays."""
    rig = lab.bus("nats-outage")
    if rig is None:
        out.skipped = "nats-server is not installed (Debian package nats-server)"
        return
    wait_until(lambda: rig.stored_batches() >= 5, 60)
    t_stop = rig.stop_nats()
    errors0 = rig.agent.metric("forewarn_uplink_push_errors_total") or 0.0
    peak = 0.0
    while time.time() - t_stop < PARTITION_S:
        peak = max(peak, rig.agent.metric("forewarn_uplink_spool_batches") or 0.0)
        time.sleep(1.0)
    errors = (rig.agent.metric("forewarn_uplink_push_errors_total") or 0.0) - errors0
    rig.start_nats()
    drained = _settle(rig, out, "after NATS came back", timeout=60 + PARTITION_S)
    out.expect(peak > 0, "nothing was spooled while NATS was down")
    out.detected = (f"agent: {int(errors)} failed publishes, spool peaked at {int(peak)} "
                    f"batches; replayed {drained} s after NATS was back")
    out.detection_s = drained
    out.action = f"spooled for {PARTITION_S:g} s (nats-server stopped), replayed in order"
    out.figures.update(outage_s=PARTITION_S, spool_peak_batches=int(peak))
    n = rig.stored_batches()
    wait_until(lambda: rig.stored_batches() >= n + 4, 60)
    _finish_telemetry(lab, rig, out, excused=[])


def _sizes(path: Path, pattern: str) -> list[int]:
    out = []
    for p in path.glob(pattern):
        with contextlib.suppress(OSError):  # sent and deleted meanwhile
            out.append(p.stat().st_size)
    return out


def spool_full(lab: Lab, out: Outcome) -> None:
    """Two ways a spool fills. (1) The bound: a cut-off longer than ``spool_max_bytes``
    holds (the agent's own defense against filling the disk). (2) The file system
    refuses writes: the agent process gets ``RLIMIT_FSIZE`` 0 (every write that grows a
    file fails with EFBIG, the same ``OSError`` path as ENOSPC on a full disk; no root or
    tiny tmpfs needed), then its limit is lifted again."""
    import resource

    o = lab.options
    bound = o.spool_max_bytes
    rig = lab.telemetry("spool-full", spool_max_bytes=bound)
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    # (1) the bound
    rig.proxy.cut(refuse=True)
    t_cut = time.time()
    peak = 0.0
    biggest = 0
    dropped = 0.0
    cut_s = max(8.0, min(o.cutoff_s, 30.0))
    while time.time() - t_cut < cut_s:
        sizes = _sizes(rig.agent.spool, "*.msgpack")
        peak = max(peak, sum(sizes))
        biggest = max([biggest, *sizes])
        dropped = rig.agent.metric("forewarn_uplink_dropped_batches_total") or 0.0
        time.sleep(0.5)
    rig.proxy.restore()
    t_restored = time.time()
    drained = _settle(rig, out, "after the cut ended")
    # The spool keeps the newest batch even when it alone is over the bound, so it may
    # pass the bound by one batch between a seal and the drop.
    out.expect(peak <= bound + biggest, f"spool reached {int(peak)} bytes, bound {bound} "
               f"plus one batch ({biggest})")
    # (2) the file system refuses writes
    pid = rig.agent.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    errors0 = rig.agent.metric("forewarn_uplink_spool_write_errors_total") or 0.0
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, hard))
    t_full = time.time()
    time.sleep(o.disk_full_s)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
    t_free = time.time()
    write_errors = (rig.agent.metric("forewarn_uplink_spool_write_errors_total") or 0.0) - errors0
    out.expect(write_errors > 0, "no spool write failed while the file system refused writes")
    _settle(rig, out, "after the file system took writes again")
    lost_samples = rig.agent.metric("forewarn_uplink_dropped_samples_total") or 0.0
    out.expect(lost_samples == 0, f"{lost_samples} samples dropped from memory")
    out.detected = (f"agent: spool held at its bound ({int(peak)} of {bound} bytes peak), "
                    f"{int(dropped)} oldest batches dropped and counted; then "
                    f"{int(write_errors)} spool writes failed (EFBIG) and were retried")
    out.detection_s = drained
    out.action = ("(1) oldest batches dropped at the spool bound (spool_max_bytes), newest "
                  "kept and replayed; (2) records kept in memory while the disk refused "
                  "writes, sealed and sent once it took them again")
    out.figures.update(spool_max_bytes=bound, spool_peak_bytes=int(peak), cut_s=cut_s,
                       batch_bytes=biggest, disk_full_s=_r(t_free - t_full),
                       spool_write_errors=int(write_errors),
                       samples_dropped_from_memory=int(lost_samples))
    n = rig.stored_batches()
    wait_until(lambda: rig.stored_batches() >= n + 4, 30)
    _finish_telemetry(lab, rig, out, excused=[(t_cut - 1.0, t_restored + 1.0)],
                      expect_drops=True)
    out.lost += ("; nothing while the disk refused writes (no sample gap outside the "
                 "cut-off)")


# --------------------------------------------------------------------------- hostile input
# A scenario's own client posts what a broken or hostile agent would, with a token of its
# own node on the rig's collector, beside the rig's real agent, whose data is then
# accounted as in the telemetry scenarios: one bad input must cost nobody else anything.

def _post(rig: TelemetryRig, node: str, batch: dict[str, Any],
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST ``batch`` (msgpack) to the rig's collector as ``node``; (status, body)."""
    import httpx
    import msgspec

    h = {"content-type": "application/msgpack",
         "authorization": f"Bearer {rig.token(node)}", **(headers or {})}
    r = httpx.post(rig.collector.url + "/api/v1/ingest", content=msgspec.msgpack.encode(batch),
                   headers=h, timeout=10)
    return r.status_code, r.text


def _sample(node: str, gpu: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"node": node, "gpu": gpu, "time": t, "source": "sim", "simulated": True,
            "temperature_c": 60.0, "power_w": 300.0, "ecc_corrected_volatile": 1, **fields}


def _batch(node: str, agent_id: str, seq: int, samples: list[dict[str, Any]],
           created: float | None = None, **more: Any) -> dict[str, Any]:
    return {"node": node, "agent_id": agent_id, "seq": seq,
            "created": time.time() if created is None else created, "samples": samples,
            **more}


def _parquet_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.parquet") if p.is_file())


def _new_parquet(rig: TelemetryRig, since: float, timeout: float = 30.0) -> bool:
    """A Parquet file written after ``since`` appears in the collector's data dir."""
    def fresh() -> bool:
        return any(p.stat().st_mtime > since for p in _parquet_files(rig.collector.data))
    return wait_until(fresh, timeout, step=0.2) is not None


POISONS: tuple[tuple[str, str, Any], ...] = (
    ("+Inf power", "power_w", float("inf")),
    ("millisecond timestamp", "time", None),  # filled in with now * 1000
    ("NVML 2^64-1 sentinel", "ecc_corrected_volatile", 2**64 - 1),
)


def poisoned_sample(lab: Lab, out: Outcome) -> None:
    poisoner = "chaos-poisoner"
    rig = lab.telemetry("poisoned", others=(poisoner,))
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    answers = []
    t0 = time.time()
    for seq, (what, fieldname, value) in enumerate(POISONS):
        now = time.time()
        bad = _sample(poisoner, 1, now, **{fieldname: now * 1000 if value is None else value})
        status, text = _post(rig, poisoner, _batch(poisoner, "chaos-poisoner-agent", seq,
                                                   [_sample(poisoner, 0, now), bad]))
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
    flushed = _new_parquet(rig, time.time() + 0.1)
    out.expect(flushed, "no Parquet file was written after the poisoned batches (flush "
               "wedged)")
    flush_errors = rig.collector.metric("forewarn_collector_telemetry_flush_errors_total")
    out.expect(not flush_errors, f"{flush_errors} failed flushes after the poison")
    out.detected = ("collector: " + "; ".join(f"{w} -> {s}" for w, s, _ in answers)
                    + f"; {int(refused)} records refused, {int(rejected)} batches rejected "
                    "(metrics)")
    out.detection_s = _r(time.time() - t0)
    out.action = "the poisoned rows were refused by field; the next flushes wrote Parquet"
    out.figures.update(poisons=len(POISONS), refused_records=int(refused),
                       rejected_batches=int(rejected), flush_errors=int(flush_errors or 0),
                       flushed_after=flushed, answers=[f"{w}: {s}" for w, s, _ in answers])
    n = rig.stored_batches()
    wait_until(lambda: rig.stored_batches() >= n + 4, 30)
    _finish_telemetry(lab, rig, out, excused=[])
    out.lost += " of the real agent; only the poisoned rows were refused"


def impostor_agent(lab: Lab, out: Outcome) -> None:
    impostor = "chaos-intruder"
    rig = lab.telemetry("impostor", others=(impostor,))
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    state = rig.agent.spool_state()
    victim_id, next_seq = str(state["agent_id"]), int(state["next_seq"])
    # The impostor claims the victim's next seqs: stored, they would make the victim's
    # real batches with those seqs look like duplicates.
    n_forged = 20
    statuses = []
    t0 = time.time()
    for seq in range(next_seq, next_seq + n_forged):
        status, text = _post(rig, impostor, _batch(
            impostor, victim_id, seq, [_sample(impostor, 0, time.time())]))
        statuses.append(status)
    out.figures["last_answer"] = text[:300]
    forbidden = statuses.count(403)
    out.expect(forbidden == n_forged, f"{forbidden} of {n_forged} forged batches refused "
               f"with 403 (answers {sorted(set(statuses))})")
    mismatch = rig.collector.metric("forewarn_collector_ingest_rejected_total",
                                    reason="identity_mismatch") or 0.0
    out.detected = (f"collector: {forbidden}/{n_forged} batches under another node's "
                    f"agent_id refused 403; {int(mismatch)} counted identity_mismatch")
    out.detection_s = _r(time.time() - t0)
    out.action = "forged batches refused; the victim's real batches (same seqs) stored"
    out.figures.update(forged=n_forged, refused_403=forbidden,
                       identity_mismatch_counted=int(mismatch), forged_seqs=
                       f"{next_seq}-{next_seq + n_forged - 1}")
    # the victim must get past every forged seq
    wait_until(lambda: int(rig.agent.spool_state()["next_seq"]) > next_seq + n_forged + 2,
               60, step=0.5)
    _finish_telemetry(lab, rig, out, excused=[])


SKEW_S = 3600.0
"""The skewed agent's clock is this far ahead (an hour: beyond ingest_max_future_s)."""


def clock_skew(lab: Lab, out: Outcome) -> None:
    """The agent's clock is not injectable: this client posts what an agent whose clock is
    an hour ahead would (its Forewarn-Sent-At header and its sample times), then what it
    posts once its clock is fixed."""
    skewed = "chaos-skewed"
    rig = lab.telemetry("clock-skew", others=(skewed,))
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    now = time.time()
    t0 = now
    status, text = _post(rig, skewed, _batch(
        skewed, "chaos-skewed-agent", 0, [_sample(skewed, g, now + SKEW_S) for g in (0, 1)],
        created=now + SKEW_S), headers={"Forewarn-Sent-At": f"{now + SKEW_S:.3f}"})
    refused_future = (status == 200 and text.count('"time"') >= 2) or 400 <= status < 500
    out.expect(refused_future, f"future samples answered {status} {text[:200]!r}, expected "
               "them refused (reason time)")
    skew = rig.collector.metric("forewarn_collector_agent_clock_skew_seconds", node=skewed)
    out.expect(skew is not None and abs(skew - SKEW_S) < 30,
               f"clock skew of {skewed} reported as {skew}, expected about {SKEW_S:g} s")
    # The clock is fixed: its rows must follow real time, not stay frozen an hour ahead.
    fixed = time.time()
    s2, t2 = _post(rig, skewed, _batch(
        skewed, "chaos-skewed-agent", 1, [_sample(skewed, g, fixed) for g in (0, 1)]),
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
    out.detection_s = _r(time.time() - t0)
    out.action = "future samples refused; the rows follow the agent once its clock is fixed"
    out.figures.update(skew_set_s=SKEW_S, skew_reported_s=_r(skew), future_answer=status,
                       real_rows_lag_s=_r(lag))
    _finish_telemetry(lab, rig, out, excused=[])


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
    from prometheus_client.parser import text_string_to_metric_families

    got = {}
    with urllib.request.urlopen(rig.collector.url + "/metrics", timeout=5) as r:
        text = r.read().decode()  # one scrape: the count and the bucket agree
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "forewarn_collector_ingest_lag_seconds_count" or (
                    smp.name == "forewarn_collector_ingest_lag_seconds_bucket"
                    and float(smp.labels.get("le", "nan")) == after_s):
                got[smp.name.rsplit("_", 1)[1]] = int(smp.value)
    total = got.get("count", 0)
    return total, total - got.get("bucket", 0)


SLOWLORIS_LATE_S = 5.0
"""An agent's batch must be stored within this long of being sealed, attack or not."""


def slowloris(lab: Lab, out: Outcome) -> None:
    import resource

    rig = lab.telemetry("slowloris")
    resource.prlimit(rig.collector.pid, resource.RLIMIT_NOFILE,
                     (SLOWLORIS_NOFILE, SLOWLORIS_NOFILE))
    wait_until(lambda: rig.stored_batches() >= 5, 30)
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
    _settle(rig, out, "after the attack")
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
                       api_read_stall_s=_r(read_stall))
    _finish_telemetry(lab, rig, out, excused=[])


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
        "forewarn.chaos.workload", "light", "--job", STORM_JOB, "--gpu", "1", "--socket",
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
    status, text = _post(rig, rig.node, _batch(rig.node, "chaos-storm-fault", 0, [],
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
    out.detection_s = _r(latency)
    out.action = f"checkpoint ordered for {STORM_JOB} {latency and round(latency, 3)} s after "\
        "the fault"
    out.figures.update(alerts_sent=sent, storm_s=storm_s, posts_before_fault=during,
                       order_latency_s=_r(latency, 3),
                       alert_answers={str(a): answers.count(a) for a in set(answers)})
    _finish_telemetry(lab, rig, out, excused=[])


_ROW = ["agent_id", "seq", "gpu", "time"]


def _kept_rows(data: Path) -> set[tuple[Any, ...]]:
    """(agent_id, seq, gpu, time) of every sample row a stopped collector's data dir still
    holds: in any Parquet file under it (quarantine included) or staged and readable."""
    import pyarrow.parquet as pq

    from forewarn.collector.metrics import CollectorMetrics
    from forewarn.collector.storage.staging import StagingLog
    from forewarn.collector.storage.store import Store
    from forewarn.collector.storage.telemetry import TelemetryWriter

    rows: set[tuple[Any, ...]] = set()
    for p in _parquet_files(data):
        with contextlib.suppress(Exception):  # a damaged file is reported elsewhere
            t = pq.read_table(p, columns=_ROW).to_pydict()
            rows.update(zip(*(t[c] for c in _ROW), strict=True))
    store = Store(data / "collector.db")
    try:
        staged = TelemetryWriter(store, data / "telemetry", CollectorMetrics(),
                                 staging=StagingLog(data / "staging")).read()
    finally:
        store.close()
    if len(staged):
        rows.update(zip(*(staged[c].tolist() for c in _ROW), strict=True))
    return rows


def _swap_db(data: Path, replacement: Path | None) -> None:
    """Replace ``collector.db`` (and its WAL) with ``replacement``, or an empty file."""
    for suffix in ("", "-wal", "-shm"):
        (data / f"collector.db{suffix}").unlink(missing_ok=True)
    target = data / "collector.db"
    if replacement is None:
        target.write_bytes(b"")
    else:
        target.write_bytes(replacement.read_bytes())


def _restart_on(rig: TelemetryRig, what: str) -> tuple[str, str]:
    """Start the collector on a swapped database: ("refused", its error) or ("started",
    "")."""
    size = rig.collector.log.stat().st_size
    try:
        rig.collector.start()
    except RuntimeError:
        with rig.collector.log.open("rb") as f:
            f.seek(size)
            return "refused", f.read().decode(errors="replace")[-1500:]
    return "started", ""


def collector_mismatched_db(lab: Lab, out: Outcome) -> None:
    import sqlite3

    rig = lab.telemetry("mismatched-db")
    c = rig.collector
    db = c.data / "collector.db"
    wait_until(lambda: rig.stored_batches() >= 5 and _parquet_files(c.data / "telemetry"), 30)
    older = c.dir / "older.db"

    def backup_while_staged() -> int:
        """A consistent copy, as a backup taken now would be; taken again until it holds
        staged (not yet flushed) batches, the case where a backup is oldest."""
        with contextlib.closing(sqlite3.connect(db)) as src, \
                contextlib.closing(sqlite3.connect(older)) as dst:
            src.backup(dst)
            return int(dst.execute("SELECT count(*) FROM staged_samples").fetchone()[0])

    staged = wait_until(backup_while_staged, 20, step=0.05) or 0
    out.figures["staged_batches_in_backup"] = staged
    _new_parquet(rig, time.time() + 0.1)  # files the older database will not know
    c.stop()
    rows = _kept_rows(c.data)
    files = len(_parquet_files(c.data))
    results: dict[str, Any] = {}
    for variant, replacement in (("empty", None), ("older", older)):
        _swap_db(c.data, replacement)
        result, error = _restart_on(rig, variant)
        if result == "started":
            quarantined = _parquet_files(c.data / "quarantine")
            counted = c.metric("forewarn_collector_quarantined_files_total") or 0.0
            c.stop()
            out.expect(bool(quarantined) and counted > 0,
                       f"{variant} collector.db: started with {len(quarantined)} Parquet "
                       f"files quarantined ({int(counted)} counted); expected a refusal or "
                       "the unaccounted files quarantined")
            results[variant] = f"started, {len(quarantined)} Parquet files quarantined"
        else:
            out.expect(str(db) in error or "collector.db" in error,
                       f"{variant} collector.db: start refused without naming {db}: "
                       f"{error[-300:]!r}")
            results[variant] = "refused: " + next(
                (ln.strip() for ln in error.splitlines() if "collector.db" in ln), error[-200:])
        kept = _kept_rows(c.data)
        lost = len(rows - kept)
        out.expect(lost == 0, f"{variant} collector.db: {lost} of {len(rows)} Parquet rows "
                   "gone from the data dir (deleted)")
        results[f"{variant}_rows_lost"] = lost
    out.detected = "; ".join(f"{k} collector.db: {v}" for k, v in results.items()
                             if not k.endswith("_lost"))
    out.detection_s = None
    out.action = "collector restarted on an empty, then an older, collector.db"
    out.lost = (f"{max(results['empty_rows_lost'], results['older_rows_lost'])} of "
                f"{len(rows)} Parquet rows ({files} files) deleted")
    out.figures.update(parquet_files=files, parquet_rows=len(rows), **results)
    rig.agent.stop()


DISK_MB = 8


def _fill(path: Path) -> int:
    """Write ``path`` until the file system is full; returns the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12):
            block = b"\0" * chunk
            try:
                while True:
                    written += f.write(block)
            except OSError:
                continue
    return written


def disk_full(lab: Lab, out: Outcome) -> None:
    """The collector's data dir and the agent's spool on one tmpfs of ``DISK_MB`` MiB,
    filled up, then freed."""
    import subprocess

    mnt = lab.dir / "disk-full-fs"
    mnt.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs",
                              str(mnt)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        out.skipped = (f"cannot mount a {DISK_MB} MiB tmpfs (needs root or CAP_SYS_ADMIN): "
                       f"{mounted.stderr.strip()[:200]}")
        return
    try:
        _disk_full(lab, out, mnt)
    finally:
        # the rig's processes are stopped by then, or die with the lab: lazily
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def _disk_full(lab: Lab, out: Outcome, mnt: Path) -> None:
    rig = lab.telemetry("disk-full", disk=mnt)
    c = rig.collector
    wait_until(lambda: rig.stored_batches() >= 5, 30)
    full_s = 8.0
    filler = mnt / "filler"
    filled = _fill(filler)
    t_full = time.time()
    flush0 = c.metric("forewarn_collector_telemetry_flush_errors_total") or 0.0
    spool0 = rig.agent.metric("forewarn_uplink_spool_write_errors_total") or 0.0
    ready_codes: set[int] = set()
    alive = True
    while time.time() - t_full < full_s:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(c.url + "/readyz", timeout=2) as r:
                ready_codes.add(r.status)
        except urllib.error.HTTPError as e:
            ready_codes.add(e.code)
        except OSError:
            alive = False
        time.sleep(0.5)
    flush_errors = (c.metric("forewarn_collector_telemetry_flush_errors_total") or 0.0) - flush0
    spool_errors = (rig.agent.metric("forewarn_uplink_spool_write_errors_total") or 0.0) - spool0
    filler.unlink()
    t_free = time.time()
    alive = alive and lab.procs.procs[c.name].poll() is None
    out.expect(alive, "the collector died or stopped answering while the disk was full")
    visible = flush_errors > 0 or any(code != 200 for code in ready_codes)
    out.expect(visible, f"no visible error while the disk was full (readyz {ready_codes}, "
               f"{int(flush_errors)} flush errors)")
    written = _new_parquet(rig, t_free)
    out.expect(written, "no Parquet file written after the space was freed")
    drained = _settle(rig, out, "after the space was freed")
    out.detected = (f"collector: readyz {sorted(ready_codes)}, {int(flush_errors)} flush "
                    f"errors; agent: {int(spool_errors)} spool write errors")
    out.detection_s = drained
    out.action = (f"a {DISK_MB} MiB tmpfs (data dir and spool) filled for {full_s:g} s, then "
                  "freed: Parquet written again, spool replayed")
    out.figures.update(disk_mb=DISK_MB, filled_bytes=filled, full_s=full_s,
                       readyz=sorted(ready_codes), flush_errors=int(flush_errors),
                       spool_write_errors=int(spool_errors), written_after_free=written)
    n = rig.stored_batches()
    wait_until(lambda: rig.stored_batches() >= n + 4, 30)
    _finish_telemetry(lab, rig, out, excused=[])


# --------------------------------------------------------------------------- registry

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("rank_killed", "training",
             "kill -9 one rank: the agent reports it gone, the launcher restarts the job "
             "from its newest checkpoint; lost = steps since that checkpoint", rank_killed),
    Scenario("rank_hung", "training",
             "one rank stops stepping (beats go on): the agent calls it hung within "
             "max(3 x p99 step time, 2 s), ends the job's ranks, the job restarts from its "
             "newest checkpoint", rank_hung),
    Scenario("nan_loss", "training",
             "a NaN loss at step k is reported at step k; the job is rolled back to the "
             "last checkpoint before k", nan_loss),
    Scenario("grad_explosion", "training",
             "a 1000x gradient (real, through DDP) is reported at its step and the agent "
             "orders a checkpoint that both ranks save at the same step; nothing lost",
             grad_explosion),
    Scenario("straggler", "training",
             "one rank computes 4x slower: reported as a straggler against its peer; the "
             "job goes on", straggler),
    Scenario("corrupt_checkpoint", "training",
             "the newest checkpoint is corrupted on disk and the job crashes: the sha256 "
             "check skips it and the previous good checkpoint is loaded", corrupt_checkpoint),
    Scenario("ecc_storm_dbe", "hardware",
             "correctable-ECC storm ending in a double-bit error (XID 48): the storm is "
             "seen first, a checkpoint is ordered before the DBE, the DBE is unhealthy",
             ecc_storm_dbe),
    Scenario("xid79_off_bus", "hardware",
             "PCIe replays grow until the GPU falls off the bus (XID 79): replays seen "
             "first, a checkpoint is ordered before, the loss is unhealthy", xid79_off_bus),
    Scenario("row_remap_failure", "hardware",
             "row remaps grow until remapping fails (XID 64): pending remaps seen first, a "
             "checkpoint is ordered before, the failure is unhealthy; the newest save before "
             f"it is at most {REMAP_MAX_LOSS_S:g} s old (work lost bounded)",
             row_remap_failure),
    Scenario("thermal_runaway", "hardware",
             "temperature climbs to slowdown and stays: found degraded as the margin falls "
             "under 5 °C, before hardware slowdown; the job slows but lives", thermal_runaway),
    Scenario("agent_restart", "telemetry",
             "kill -9 the agent and start it again: every batch it sealed is stored exactly "
             "once; only samples not yet sealed (< push_interval_s) die with it",
             agent_restart),
    Scenario("collector_restart", "telemetry",
             "kill -9 the collector during ingest and restart it: every batch and sample "
             "stored exactly once, no gap", collector_restart),
    Scenario("agent_cut_off", "telemetry",
             "the network between agent and collector is cut (a blackholing proxy) for "
             "minutes: the agent spools, then replays in order; nothing lost, no gap",
             agent_cut_off),
    Scenario("spool_full", "telemetry",
             "a cut-off longer than the spool can hold: the spool stays at its bound, the "
             "oldest batches are dropped and every drop is counted, the newest arrive; then "
             "the file system refuses writes (EFBIG): records wait in memory, none lost",
             spool_full),
    Scenario("poisoned_sample", "telemetry",
             "a client posts samples with +Inf, a millisecond time and NVML's 2^64-1: each "
             "refused naming its field and counted; the real agent's data all stored; the "
             "next flush writes Parquet", poisoned_sample),
    Scenario("impostor_agent", "telemetry",
             "node B's token posts under node A's agent_id and A's next seqs: 403 each; A's "
             "real batches all stored (none taken for duplicates)", impostor_agent),
    Scenario("collector_mismatched_db", "store",
             "restart the collector on an empty, then an older, collector.db: a start-up "
             "error naming the path, or the unaccounted files quarantined; no Parquet row "
             "deleted", collector_mismatched_db),
    Scenario("slowloris", "telemetry",
             f"{SLOWLORIS_SOCKETS} idle or dripping sockets for 20 s against a collector "
             f"with {SLOWLORIS_NOFILE} descriptors: the agent's batches stored within 5 s "
             "throughout, the collector's log bounded, nothing lost", slowloris),
    Scenario("alert_storm_with_fatal", "telemetry",
             "1,000 alerts/s for 20 s to the alert webhook and a fatal finding (GPU off the "
             "bus) in the middle: the checkpoint order within 1 s of it", alert_storm_with_fatal),
    Scenario("disk_full", "telemetry",
             f"the collector's data dir and the agent's spool on a full {DISK_MB} MiB tmpfs: "
             "no crash, a visible error (metric or /readyz), data written once space is "
             "freed, nothing lost", disk_full),
    Scenario("partition_60s", "telemetry",
             f"the agent is cut off its collector for {PARTITION_S:g} s: it spools, then "
             "replays; nothing lost, no gap", partition_60s),
    Scenario("nats_outage_60s", "telemetry",
             f"agent and collector on NATS JetStream; nats-server stopped for {PARTITION_S:g}"
             " s: the agent spools, then replays; nothing lost, no gap", nats_outage_60s),
    Scenario("clock_skew", "telemetry",
             f"an agent's clock {SKEW_S:g} s ahead: the skew is measured and reported, its "
             "future samples refused, its rows follow it once its clock is fixed, other "
             "GPUs' rows not frozen", clock_skew),
    *SCALE_SCENARIOS,
)


def by_name(names: list[str] | None = None) -> list[Scenario]:
    """The selected scenarios in registry order (all when ``names`` is empty)."""
    if not names:
        return list(SCENARIOS)
    known = {s.name: s for s in SCENARIOS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: "
                         f"{', '.join(known)}")
    return [s for s in SCENARIOS if s.name in names]


def run_one(lab: Lab, scenario: Scenario) -> Outcome:
    """Run one scenario; an exception becomes a failed outcome naming it."""
    out = Outcome(scenario.name, scenario.expected)
    t0 = time.monotonic()
    try:
        scenario.run(lab, out)
    except Exception as exc:  # a broken scenario is a failed one, with the reason
        out.problems.append(f"{type(exc).__name__}: {exc}")
    out.figures["scenario_s"] = round(time.monotonic() - t0, 1)
    return out.finish()
