"""Simulated multi-node data-parallel job, for judging peer comparison.

Each rank reports, every ``interval_s``: compute seconds per step, GPU utilisation,
temperature, power, SM clock and correctable-ECC rate. Healthy ranks differ by small fixed
offsets (GPU-to-GPU variance: +-2 C, +-2% power) and noise, and the whole job moves
together through phases (evaluation pauses, data-loader stalls). One rank may degrade at
``onset_s``:

* ``slow``: SM clock -25%, power -20%, compute time +30% (a fail-slow GPU; in synchronous
  data parallelism its peers then wait on it, their utilisation dips);
* ``hot``: temperature +12..20 C over a minute (failing thermal interface);
* ``erroring``: correctable ECC at 20-60 per interval and utilisation jitter.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["FAULTS", "simulate_job"]

FAULTS = ("slow", "hot", "erroring")


def simulate_job(*, nodes: int = 4, gpus_per_node: int = 8, duration_s: float = 600.0,
                 interval_s: float = 1.0, fault: str | None = "slow", onset_s: float = 300.0,
                 victim: int | None = None, seed: int = 0) -> tuple[pd.DataFrame, int | None]:
    """Return (table ``job, member, time, <metrics>``, the degraded rank or None)."""
    rng = np.random.default_rng(seed)
    n = nodes * gpus_per_node
    t_count = int(duration_s / interval_s)
    times = 1_767_225_600.0 + np.arange(t_count) * interval_s
    # Job-wide phases: every rank alike.
    phase = np.ones(t_count)
    for _ in range(rng.poisson(2)):
        s = int(rng.integers(t_count))
        phase[s:s + int(rng.integers(10, 60) / interval_s)] = rng.uniform(0.3, 0.7)
    shape = (n, t_count)
    temp = 60 + rng.normal(0, 2, (n, 1)) + 15 * phase + rng.normal(0, 0.7, shape)
    power = 650 * (1 + rng.normal(0, 0.02, (n, 1))) * phase + rng.normal(0, 8, shape)
    clock = 1980 + rng.normal(0, 5, shape)
    compute = 1.0 * (1 + rng.normal(0, 0.01, (n, 1))) + rng.normal(0, 0.01, shape)
    util = 95 * phase + rng.normal(0, 1.5, shape)
    ecc = rng.poisson(0.01, shape).astype(np.float64)
    if fault is not None:
        v = int(rng.integers(n)) if victim is None else victim
        on = times - times[0] >= onset_s
        ramp = np.clip((times - times[0] - onset_s) / 15.0, 0, 1)
        if fault == "slow":
            clock[v] -= 0.25 * 1980 * ramp
            power[v] -= 0.20 * 650 * ramp * phase
            compute[v] += 0.30 * ramp
            util[np.arange(n) != v] -= 6 * ramp
        elif fault == "hot":
            temp[v] += rng.uniform(12, 20) * np.clip((times - times[0] - onset_s) / 60, 0, 1)
        elif fault == "erroring":
            ecc[v] += np.where(on, rng.integers(20, 60, t_count), 0)
            util[v] += np.where(on, rng.normal(0, 6, t_count), 0)
        else:
            raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")
    else:
        v = None
    df = pd.DataFrame({
        "job": "job-sim",
        "member": np.repeat(np.arange(n), t_count),
        "time": np.tile(times, n),
        "compute_s": compute.ravel(), "gpu_util_pct": util.ravel(),
        "temperature_c": temp.ravel(), "power_w": power.ravel(),
        "sm_clock_mhz": clock.ravel(), "ecc_per_interval": ecc.ravel(),
    })
    return df, v
