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

import dataclasses
from collections.abc import Callable

import numpy as np
import pandas as pd

__all__ = ["FAULTS", "simulate_job"]


@dataclasses.dataclass
class _Job:
    """The job's per-rank series, shape (ranks, time), while a fault is applied to ``v``."""

    phase: np.ndarray
    temp: np.ndarray
    power: np.ndarray
    clock: np.ndarray
    compute: np.ndarray
    util: np.ndarray
    ecc: np.ndarray


def _slow(j: _Job, rng: np.random.Generator, v: int, since: np.ndarray) -> None:
    """Fail-slow: clock, power and compute time move over 15 s; the peers wait on it."""
    ramp = np.clip(since / 15.0, 0, 1)
    j.clock[v] -= 0.25 * 1980 * ramp
    j.power[v] -= 0.20 * 650 * ramp * j.phase
    j.compute[v] += 0.30 * ramp
    j.util[np.arange(len(j.util)) != v] -= 6 * ramp


def _hot(j: _Job, rng: np.random.Generator, v: int, since: np.ndarray) -> None:
    """Failing thermal interface: +12..20 C over a minute."""
    j.temp[v] += rng.uniform(12, 20) * np.clip(since / 60, 0, 1)


def _erroring(j: _Job, rng: np.random.Generator, v: int, since: np.ndarray) -> None:
    """Correctable ECC at 20-60 per interval, utilisation jitter."""
    on = since >= 0
    j.ecc[v] += np.where(on, rng.integers(20, 60, len(since)), 0)
    j.util[v] += np.where(on, rng.normal(0, 6, len(since)), 0)


_FAULT_KINDS: dict[str, Callable[[_Job, np.random.Generator, int, np.ndarray], None]] = {
    "slow": _slow, "hot": _hot, "erroring": _erroring,
}
"""What each fault does to the degraded rank ``v``, given the seconds ``since`` its onset
(negative before): the one table of the job simulator's fault kinds."""

FAULTS = tuple(_FAULT_KINDS)


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
    j = _Job(
        phase=phase,
        temp=60 + rng.normal(0, 2, (n, 1)) + 15 * phase + rng.normal(0, 0.7, shape),
        power=650 * (1 + rng.normal(0, 0.02, (n, 1))) * phase + rng.normal(0, 8, shape),
        clock=1980 + rng.normal(0, 5, shape),
        compute=1.0 * (1 + rng.normal(0, 0.01, (n, 1))) + rng.normal(0, 0.01, shape),
        util=95 * phase + rng.normal(0, 1.5, shape),
        ecc=rng.poisson(0.01, shape).astype(np.float64),
    )
    v = None
    if fault is not None:
        v = int(rng.integers(n)) if victim is None else victim
        if fault not in _FAULT_KINDS:
            raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")
        _FAULT_KINDS[fault](j, rng, v, times - times[0] - onset_s)
    df = pd.DataFrame({
        "job": "job-sim",
        "member": np.repeat(np.arange(n), t_count),
        "time": np.tile(times, n),
        "compute_s": j.compute.ravel(), "gpu_util_pct": j.util.ravel(),
        "temperature_c": j.temp.ravel(), "power_w": j.power.ravel(),
        "sm_clock_mhz": j.clock.ravel(), "ecc_per_interval": j.ecc.ravel(),
    })
    return df, v
