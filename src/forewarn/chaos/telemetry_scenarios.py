"""The telemetry rig's chaos scenarios of loss and outage (on a
:class:`~forewarn.chaos.telemetry_rig.TelemetryRig` or a
:class:`~forewarn.chaos.telemetry_rig.BusRig`):
restarts, cuts, a NATS outage, a full spool; nothing sealed may be lost."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from forewarn.chaos.lab import Lab
from forewarn.chaos.outcome import Outcome
from forewarn.chaos.scenario_tools import (
    finish_telemetry,
    more_batches,
    rounded,
    settle,
)
from forewarn.chaos.telemetry_rig import TelemetryRig
from forewarn.spawn.procs import wait_until


def agent_restart(lab: Lab, out: Outcome) -> None:
    o = lab.options
    rig = lab.telemetry("agent-kill")
    rig.storing()
    t_kill = rig.agent.kill9()
    time.sleep(1.0)
    rig.agent.start()
    t_back = time.time()
    drained = settle(rig, out, "after the restart")
    got = wait_until(lambda: rig.stored_batches(), 1)
    out.detected = ("collector: agent's batches resume after its restart; spool replayed "
                    f"{drained} s after the agent was back")
    out.detection_s = drained
    out.action = "agent restarted on the same spool (same agent_id, seq goes on), replayed"
    wait_until(lambda: rig.stored_batches() >= (got or 0) + 4, 30)
    acc = finish_telemetry(lab, rig, out,
                            excused=[(t_kill - o.push_interval_s - 1.0, t_back + 1.0)])
    # What a kill -9 cannot save: samples polled but not yet sealed into a batch.
    before = [a for a, _b in acc.excused_gaps] if acc else []
    unsealed = rounded(t_kill - max(before)) if before else None
    out.figures.update(unsealed_at_kill_s=unsealed, unsealed_bound_s=o.push_interval_s,
                       downtime_s=rounded(t_back - t_kill))
    out.expect(unsealed is not None and unsealed <= o.push_interval_s + 0.5,
               f"{unsealed} s of samples before the kill are missing (bound "
               f"{o.push_interval_s} s + 0.5 s)")
    out.lost += (f"; the last {unsealed} s of samples before the kill -9 were polled but not "
                 f"yet sealed (bound: push_interval_s = {o.push_interval_s:g} s)")


def collector_restart(lab: Lab, out: Outcome) -> None:
    rig = lab.telemetry("collector-kill")
    rig.storing()
    t_kill = rig.collector.kill9()
    grew = wait_until(lambda: (rig.agent.metric("forewarn_uplink_spool_batches") or 0) > 0, 20)
    out.expect(grew is not None, "the agent did not spool while the collector was down")
    time.sleep(1.5)
    rig.collector.start()
    t_back = time.time()
    drained = settle(rig, out, "after the collector came back")
    out.detected = ("agent: push errors, batches held in the spool; replayed "
                    f"{drained} s after the collector was back")
    out.detection_s = drained
    out.action = "kill -9 collector, restarted on the same data; agent replayed its spool"
    out.figures["downtime_s"] = rounded(t_back - t_kill)
    more_batches(rig)
    finish_telemetry(lab, rig, out, excused=[])


def _outage(rig: TelemetryRig, out: Outcome, seconds: float, begin: Callable[[], object],
            end: Callable[[], object], what: str, wait_s: float) -> tuple[int, int, float | None]:
    """Once the rig stored a few batches, ``begin()`` an outage of the agent's uplink,
    watch the agent's spool for ``seconds``, ``end()`` it and wait for the spool to
    drain; returns (failed sends, spool peak in batches, drain time). ``what`` names the
    outage in the problems ("nothing was spooled during the cut")."""
    rig.storing(timeout=wait_s)
    t0 = time.time()
    begin()
    errors0 = rig.agent.metric("forewarn_uplink_push_errors_total") or 0.0
    peak = 0.0
    while time.time() - t0 < seconds:
        peak = max(peak, rig.agent.metric("forewarn_uplink_spool_batches") or 0.0)
        time.sleep(min(1.0, seconds / 10))
    errors = (rig.agent.metric("forewarn_uplink_push_errors_total") or 0.0) - errors0
    end()
    drained = settle(rig, out, f"after the {what}", timeout=60 + seconds)
    out.expect(peak > 0, f"nothing was spooled during the {what}")
    return int(errors), int(peak), drained


def _cut_off(lab: Lab, out: Outcome, name: str, cut_s: float) -> None:
    """Cut the agent off its collector at the proxy for ``cut_s``; nothing may be lost."""
    rig = lab.telemetry(name)
    errors, peak, drained = _outage(rig, out, cut_s, rig.proxy.cut, rig.proxy.restore,
                                    "cut", 30)
    out.detected = (f"agent: {errors} failed pushes, spool peaked at {peak} batches; "
                    f"replayed {drained} s after the link came back")
    out.detection_s = drained
    out.action = f"spooled for {cut_s:g} s (network cut at a proxy), replayed in order"
    out.figures.update(cutoff_s=cut_s, spool_peak_batches=peak)
    more_batches(rig)
    finish_telemetry(lab, rig, out, excused=[])


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
    errors, peak, drained = _outage(rig, out, PARTITION_S, rig.nats_server.stop,
                                    rig.nats_server.start, "NATS outage", 60)
    out.detected = (f"agent: {errors} failed publishes, spool peaked at {peak} "
                    f"batches; replayed {drained} s after NATS was back")
    out.detection_s = drained
    out.action = f"spooled for {PARTITION_S:g} s (nats-server stopped), replayed in order"
    out.figures.update(outage_s=PARTITION_S, spool_peak_batches=peak)
    more_batches(rig, 60)
    finish_telemetry(lab, rig, out, excused=[])


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
    rig.storing()
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
    drained = settle(rig, out, "after the cut ended")
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
    settle(rig, out, "after the file system took writes again")
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
                       batch_bytes=biggest, disk_full_s=rounded(t_free - t_full),
                       spool_write_errors=int(write_errors),
                       samples_dropped_from_memory=int(lost_samples))
    more_batches(rig)
    finish_telemetry(lab, rig, out, excused=[(t_cut - 1.0, t_restored + 1.0)],
                      expect_drops=True)
    out.lost += ("; nothing while the disk refused writes (no sample gap outside the "
                 "cut-off)")
