"""Agent cost benchmark: CPU time per poll cycle and resident memory, 8 GPUs, 1 s interval.

Runs against the FAKE ``libnvidia-ml.so.1`` from ``tests/fake_nvml/`` (compiled here with
gcc), configured with 8 GPUs that support every field (18 NVLink links each, like an
H100 SXM), so nvidia-ml-py's real code runs on every call. The fake answers from memory;
a real driver's ioctls cost more (see bench/RESULTS.md for a run on a GPU, where one is).

Two measurements:

1. ``source``: :class:`forewarn.agent.sources.nvml.NvmlBackend` in this process, polled
   back to back for ``--cycles`` cycles; CPU per cycle = process CPU time / cycles (the
   XID event thread runs meanwhile and is counted). At a 1 s interval the share of one
   core is CPU per cycle / 1 s. RSS is this process's (Python + pynvml + forewarn).
2. ``daemon``: ``forewarn agent --source nvml`` in a child process (fake library through
   ``LD_LIBRARY_PATH``), polling every second for ``--duration`` seconds with its
   checks and /metrics endpoint; CPU from ``/proc/<pid>/stat`` (utime + stime) over the
   window, RSS (VmRSS, peak VmHWM) from ``/proc/<pid>/status``.

Goal (issue 2): under 0.5% of one core and under 60 MiB RSS at a 1 s interval.

Usage: ``python bench/agent_poll.py [--cycles 2000] [--duration 30] [--settle 3] [--no-daemon]
[--sim-baseline]``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
GOAL_CPU_PCT = 0.5
GOAL_RSS_MIB = 60.0


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fake_nvml_build", ROOT / "tests" / "fake_nvml" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_config(gpus: int, links: int) -> str:
    """A node where every field is supported and every counter is non-zero."""
    lines = [f"count {gpus}", f"*.nvlinks {links}"]
    values = {
        "temp": 63, "memtemp": 71, "margin": 21, "power_mw": 512345,
        "power_limit_mw": 700000, "sm_clock": 1980, "mem_clock": 2619, "util_gpu": 98,
        "util_mem": 45, "mem_used": 64 << 30, "throttle": 1, "pstate": 0, "ecc_sbe_vol": 3,
        "ecc_dbe_vol": 0, "ecc_sbe_agg": 17, "ecc_dbe_agg": 0, "retired_sbe": 0,
        "retired_dbe": 0, "retired_pending": 0, "remap_cor": 2, "remap_unc": 0,
        "remap_pending": 0, "remap_failure": 0, "pcie_replay": 5, "link_gen": 5,
        "link_gen_max": 5, "link_width": 16, "link_width_max": 16, "nvlink_crc_flit": 1,
        "nvlink_crc_data": 1, "nvlink_replay": 1, "nvlink_recovery": 0,
    }
    lines += [f"*.{k} {v}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def rss_mib(pid: int | str = "self") -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(rest.split()[0]) / 1024.0
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    after_comm = stat.rsplit(")", 1)[1].split()
    ticks = int(after_comm[11]) + int(after_comm[12])  # fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def bench_source(lib: Path, cycles: int) -> dict[str, float]:
    from forewarn.agent.sources.nvml import NvmlBackend

    backend = NvmlBackend("bench", library_path=lib)
    infos = backend.open()
    try:
        for _ in range(20):  # warm up: first polls drop nothing here, but fill caches
            backend.sample(time.time())
        sample = backend.sample(time.time())[0]
        assert not sample.unsupported and not sample.errors, (sample.unsupported, sample.errors)
        assert len(sample.nvlink) > 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(cycles):
            backend.sample(time.time())
            backend.drain_xids()
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        rss, hwm = rss_mib()
    finally:
        backend.close()
    per_cycle = cpu / cycles
    return {
        "gpus": len(infos),
        "cpu_ms_per_cycle": per_cycle * 1e3,
        "wall_ms_per_cycle": wall / cycles * 1e3,
        "core_pct_at_1s": per_cycle * 100.0,
        "rss_mib": rss,
        "hwm_mib": hwm,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


def bench_daemon(lib: Path, config: Path, workdir: Path, duration: float,
                 gpus: int, source: str = "nvml", settle: float = 3.0) -> dict[str, float]:
    """Run ``forewarn agent --source <source>`` and measure it over ``duration`` s."""
    port = _free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib.parent), FAKE_NVML_CONFIG=str(config))
    source_args = ["--source", source]
    if source == "sim":
        source_args += ["--sim-gpus", str(gpus)]
    cmd = [sys.executable, "-m", "forewarn", "agent", *source_args, "--no-kmsg",
           "--interval", "1", "--listen", f"127.0.0.1:{port}", "--node", "bench",
           "--socket", str(workdir / "agent.sock"), "--log-level", "warning"]
    log_path = workdir / f"agent-{source}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        text = None
        while time.monotonic() < deadline and proc.poll() is None:
            text = _get(url)
            if text and text.count("forewarn_gpu_temperature_celsius{") >= gpus:
                break
            time.sleep(0.2)
        if not text or proc.poll() is not None:
            raise RuntimeError(f"agent did not come up; log:\n{log_path.read_text()[-4000:]}")
        # Let start-up work settle; checks that scan the agent's 15-minute sample history
        # reach their steady cost only once it is full (--settle 900).
        time.sleep(settle)
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(duration)
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        rss, hwm = rss_mib(proc.pid)
        text = _get(url) or ""
        if text.count("forewarn_gpu_temperature_celsius{") < gpus:
            raise RuntimeError("agent stopped exporting NVML samples during the run")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    wall = t1 - t0
    cpu = cpu1 - cpu0
    return {
        "gpus": gpus,
        "cpu_ms_per_cycle": cpu / wall * 1e3,  # one cycle per second
        "wall_s": wall,
        "core_pct_at_1s": cpu / wall * 100.0,
        "rss_mib": rss,
        "hwm_mib": hwm,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--links", type=int, default=18, help="NVLink links per GPU")
    ap.add_argument("--cycles", type=int, default=2000, help="back-to-back source polls")
    ap.add_argument("--duration", type=float, default=30.0, help="daemon window, seconds")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds the daemon runs before the window (900 = full history)")
    ap.add_argument("--no-daemon", action="store_true", help="measure the source only")
    ap.add_argument("--sim-baseline", action="store_true",
                    help="also measure the daemon with --source sim (the non-NVML share)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="forewarn-bench-") as tmp:
        work = Path(tmp)
        lib = _builder().build_fake_nvml(work / "lib")
        config = work / "fake_nvml.conf"
        config.write_text(full_config(args.gpus, args.links))
        # The in-process source run first: its library then stays loaded in this process.
        os.environ["FAKE_NVML_CONFIG"] = str(config)
        rows = [("nvml source, in process", bench_source(lib, args.cycles))]
        if not args.no_daemon:
            rows.append(("forewarn agent daemon", bench_daemon(lib, config, work,
                                                                args.duration, args.gpus,
                                                                settle=args.settle)))
        if args.sim_baseline:
            rows.append(("daemon, --source sim", bench_daemon(
                lib, config, work, args.duration, args.gpus, source="sim",
                settle=args.settle)))

    print(f"\n8-GPU node, fake libnvidia-ml.so.1, all fields, {args.links} NVLink links/GPU, "
          f"1 s interval (goal: < {GOAL_CPU_PCT}% of a core, < {GOAL_RSS_MIB:.0f} MiB)")
    print(f"{'what':<26} {'GPUs':>4} {'CPU ms/cycle':>13} {'% core @1s':>11} "
          f"{'RSS MiB':>8} {'peak MiB':>9} {'goal':>5}")
    for what, r in rows:
        ok = r["core_pct_at_1s"] < GOAL_CPU_PCT and r["rss_mib"] < GOAL_RSS_MIB
        print(f"{what:<26} {r['gpus']:>4.0f} {r['cpu_ms_per_cycle']:>13.3f} "
              f"{r['core_pct_at_1s']:>11.3f} {r['rss_mib']:>8.1f} {r['hwm_mib']:>9.1f} "
              f"{'met' if ok else 'MISS':>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
