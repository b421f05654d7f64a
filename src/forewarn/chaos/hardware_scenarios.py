"""The hardware rig's chaos scenarios (:class:`~forewarn.chaos.hardware_rig.HardwareRig`):
one scripted GPU fault each, all playing out together on ``chaos-node-2``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from forewarn.chaos.hardware_rig import HW_FAULTS, HardwareRig
from forewarn.chaos.lab import Lab
from forewarn.chaos.outcome import Outcome
from forewarn.chaos.scenario_tools import (
    first_finding,
    rounded,
)
from forewarn.spawn.procs import wait_until

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
        terminal = first_finding(lab, NODE2, check, t_end - 1, 20, _gpu_match(gpu),
                                  health=("unhealthy",))
        if terminal is not None:
            break
    if out.expect(terminal is not None, f"no unhealthy {'/'.join(terminal_checks)} finding "
                  f"on GPU {gpu} after XID {xid}"):
        assert terminal is not None
        out.detection_s = rounded(max(0.0, float(terminal["time"]) - t_end))
        out.detected = f"{terminal['check']} unhealthy: {terminal['reason'][:120]}"
    _precursor_and_orders(lab, out, hw, gpu, t_end, precursor_checks, max_loss_s)


def _precursor_and_orders(lab: Lab, out: Outcome, hw: HardwareRig, gpu: int, t_end: float,
                          precursor_checks: tuple[str, ...], max_loss_s: float | None) -> None:
    pre = [f for check in precursor_checks
           for f in [first_finding(lab, NODE2, check, 0, 0.1, _gpu_match(gpu))] if f]
    first_pre = min(pre, key=lambda f: float(f["time"])) if pre else None
    if out.expect(first_pre is not None and float(first_pre["time"]) < t_end,
                  f"no precursor finding ({'/'.join(precursor_checks)}) before the failure"):
        assert first_pre is not None
        lead = t_end - float(first_pre["time"])
        out.figures["precursor"] = f"{first_pre['check']} {first_pre['health']}"
        out.figures["precursor_lead_s"] = rounded(lead)
    events = hw.events(gpu)
    at_end = max((int(e["step"]) for e in events
                  if e.get("event") == "step" and float(e["time"]) <= t_end), default=0)
    ordered = [e for e in events if e.get("event") == "checkpoint" and e.get("ordered")]
    before = [e for e in ordered if float(e["time"]) <= t_end]
    saved = max((int(e["step"]) for e in events if e.get("event") == "checkpoint"
                 and float(e["time"]) <= t_end), default=0)
    out.figures.update(step_at_failure=at_end, last_checkpoint_before=saved,
                       steps_lost=at_end - saved, progress_lost_pct=rounded(
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
        out.figures["order_lead_s"] = rounded(t_end - float(first["time"]))
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
    f = first_finding(lab, NODE2, "thermal", 0, 30, _gpu_match(gpu))
    if out.expect(f is not None, f"no thermal finding on GPU {gpu}"):
        assert f is not None
        out.detection_s = rounded(float(f["time"]) - onset)
        out.detected = f"thermal {f['health']}: {f['reason'][:120]}"
        out.action = f"suggested {f.get('action')}; the collector notifies (webhook)"
        out.expect(float(f["time"]) >= onset - 0.5, "thermal finding before the onset")
        if hw_slow is not None:
            out.figures["hw_slowdown_lead_s"] = rounded(hw_slow - float(f["time"]))
    out.lost = "0 steps (the GPU throttles, the job slows, nothing dies)"
    events = hw.events(gpu)
    out.expect(any(e.get("event") == "step" and float(e["time"]) > (hw_slow or onset)
                   for e in events), "the job on the hot GPU stopped stepping")
    out.figures["steps_lost"] = 0
