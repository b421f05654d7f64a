"""A seeded generator of GPU life histories (the lemon ranking's events format).

It is written to test :mod:`forewarn.models.lemon` without handing it its own form: the
hazard here is multiplicative and partly hidden, and the ranker only sees the effects
through what it can measure (failures and exposure per location, cohort, the GPU's own
past). Effects, per in-service day:

- **Age (bathtub):** infant mortality in the first weeks of service, a flat middle, wear-out
  after about two and a half years.
- **Bad install cohorts:** GPUs arrive in batches; about one batch in six is bad (x2.5).
- **Bad racks and chassis:** a few racks (cooling, power) multiply the hazard of every GPU
  in them (x3.5), a few chassis too (x2.5); rows vary a little (log-normal).
- **The GPU itself:** a gamma frailty, and a few lemons (x6) that fail again and again.
- **Removal for repair, then reinstall:** a failed GPU is removed; most are repaired and
  later installed into whatever slot needs a spare, with a higher hazard afterwards (x1.8)
  and an infant period again; a GPU that failed three times, or failed beyond repair, is
  retired. Its slot gets a spare (repaired, or new from the current batch).
- **Moves:** a little rebalancing moves GPUs between slots; old racks are decommissioned
  (their GPUs retired) late in the history.
- **Soft events** (XID 63/92/94, SBEs, remaps) at a rate that grows with frailty, more of
  them in the weeks before a failure.

Location is ``row/rack/chassis/node/slot``. Times are seconds since the epoch.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import numpy as np
import pandas as pd

__all__ = ["LifeParams", "simulate_life"]

DAY: Final = 86400.0
_START: Final = 1_640_995_200.0  # 2022-01-01
_SLOTS: Final = 8
_NODES_PER_CHASSIS: Final = 2
_CHASSIS_PER_RACK: Final = 2
_RACKS_PER_ROW: Final = 16
_PER_RACK: Final = _SLOTS * _NODES_PER_CHASSIS * _CHASSIS_PER_RACK
_SOFT: Final = np.array(["xid:63", "xid:92", "xid:94", "sbe", "remap"])
_HARD: Final = np.array(["dbe", "off_bus", "xid:79", "xid:48", "xid:119", "xid:74"])


@dataclasses.dataclass(frozen=True)
class LifeParams:
    """Size and effects of a simulated fleet history."""

    gpus: int = 20_000
    years: float = 4.5
    seed: int = 0
    base_per_year: float = 0.03
    """Hazard of an average GPU in a good place, mid-life, per in-service year."""
    bad_cohort_share: float = 0.17
    bad_cohort_factor: float = 2.5
    bad_rack_share: float = 0.06
    bad_rack_factor: float = 3.5
    bad_chassis_share: float = 0.04
    bad_chassis_factor: float = 2.5
    lemon_share: float = 0.02
    lemon_factor: float = 6.0
    repaired_factor: float = 1.8
    repair_share: float = 0.7
    moves_per_gpu_year: float = 0.02


def _bathtub(age_days: np.ndarray) -> np.ndarray:
    infant = 1.0 + 5.0 * np.exp(-age_days / 40.0)
    wear = 1.0 + np.clip((age_days - 900.0) / 365.0, 0.0, None) ** 1.6
    out: np.ndarray = infant * wear
    return out


class _Fleet:
    """Mutable state of the simulation: slots, GPUs and the event log."""

    def __init__(self, p: LifeParams, rng: np.random.Generator) -> None:
        self.p, self.rng = p, rng
        racks = -(-p.gpus // _PER_RACK)
        n_slots = racks * _PER_RACK
        s = np.arange(n_slots)
        rack = s // _PER_RACK
        chassis = s // (_SLOTS * _NODES_PER_CHASSIS)
        row = rack // _RACKS_PER_ROW
        self.location = [
            f"row{r:02d}/rack{k:03d}/chassis{c % _CHASSIS_PER_RACK}/"
            f"node{(i // _SLOTS) % _NODES_PER_CHASSIS}/slot{i % _SLOTS}"
            for i, r, k, c in zip(s, row, rack, chassis, strict=True)]
        row_f = rng.lognormal(0.0, 0.25, row.max() + 1)
        rack_f = np.where(rng.random(racks) < p.bad_rack_share, p.bad_rack_factor, 1.0)
        ch_f = np.where(rng.random(chassis.max() + 1) < p.bad_chassis_share,
                        p.bad_chassis_factor, 1.0)
        self.slot_factor = row_f[row] * rack_f[rack] * ch_f[chassis]
        # Racks come into service in waves over the first 40% of the history.
        days = p.years * 365.0
        self.rack_open = np.sort(rng.uniform(0.0, 0.4 * days, racks)).round()
        self.slot_open = self.rack_open[rack]
        # Oldest 15% of racks are decommissioned in the last year.
        n_old = int(0.15 * racks)
        self.rack_close = np.full(racks, np.inf)
        self.rack_close[:n_old] = rng.uniform(days - 365.0, days, n_old).round()
        self.slot_close = self.rack_close[rack]
        self.occupant = np.full(n_slots, -1)
        self.stint_start = np.zeros(n_slots)
        self.refill_at = np.full(n_slots, np.inf)
        # GPUs are created on demand; arrays grow.
        self.frailty: list[float] = []
        self.cohort: list[str] = []
        self.cohort_f: list[float] = []
        self.age = np.zeros(0)
        self.failures = np.zeros(0, np.int64)
        self.pool: list[tuple[float, int]] = []  # (ready day, gpu) repaired spares
        self.batch = -1
        self.batch_left = 0
        self.batch_f = 1.0
        self.rows: list[tuple[str, float, str, str, str]] = []

    def new_gpu(self, day: float) -> int:
        if self.batch_left <= 0:
            self.batch += 1
            self.batch_left = int(self.rng.integers(600, 2500))
            self.batch_f = (self.p.bad_cohort_factor
                            if self.rng.random() < self.p.bad_cohort_share else 1.0)
        self.batch_left -= 1
        g = len(self.frailty)
        lemon = self.rng.random() < self.p.lemon_share
        self.frailty.append(float(self.rng.gamma(2.0, 0.5)) * (self.p.lemon_factor if lemon
                                                                else 1.0))
        self.cohort.append(f"B{self.batch:03d}")
        self.cohort_f.append(self.batch_f)
        self.age = np.append(self.age, 0.0)
        self.failures = np.append(self.failures, 0)
        return g

    def emit(self, gpu: int, day: float, kind: str, location: str = "") -> None:
        cohort = self.cohort[gpu] if kind == "install" else ""
        self.rows.append((f"GPU-{gpu:06d}", _START + day * DAY, kind, location, cohort))

    def install(self, slot: int, day: float) -> None:
        ready = [i for i, (d, _g) in enumerate(self.pool) if d <= day]
        if ready and self.rng.random() < 0.6:
            _d, g = self.pool.pop(ready[0])
        else:
            g = self.new_gpu(day)
        self.occupant[slot] = g
        self.stint_start[slot] = day
        self.refill_at[slot] = np.inf
        self.emit(g, day, "install", self.location[slot])

    def fail(self, slot: int, day: float) -> None:
        g = int(self.occupant[slot])
        t = day + float(self.rng.uniform(0, 1))
        self.emit(g, t, str(self.rng.choice(_HARD)))
        for _ in range(self.rng.poisson(1.2)):  # soft precursors in the weeks before
            self.emit(g, max(self.stint_start[slot], t - float(self.rng.uniform(0, 30))),
                      str(self.rng.choice(_SOFT)))
        self.emit(g, t + float(self.rng.uniform(0, 1)), "remove")
        self.failures[g] += 1
        self.occupant[slot] = -1
        self.refill_at[slot] = day + float(self.rng.integers(1, 6))
        if self.failures[g] >= 3 or self.rng.random() > self.p.repair_share:
            self.emit(g, t + float(self.rng.uniform(1, 20)), "retire")
        else:
            self.frailty[g] *= self.p.repaired_factor
            self.pool.append((day + float(self.rng.uniform(7, 60)), g))

    def step(self, day: float) -> None:
        p, rng = self.p, self.rng
        for s in np.nonzero((self.slot_open == day) & (self.occupant < 0))[0]:
            self.install(int(s), day)
        for s in np.nonzero(self.refill_at <= day)[0]:
            if day < self.slot_close[s]:
                self.install(int(s), day)
        occ = np.nonzero(self.occupant >= 0)[0]
        g = self.occupant[occ]
        self.age[g] += 1.0
        stint = day - self.stint_start[occ]
        fr = np.asarray(self.frailty)[g]
        reinstall = np.where(self.failures[g] > 0, 1.0 + 2.0 * np.exp(-stint / 20.0), 1.0)
        h = (p.base_per_year / 365.0) * fr * np.asarray(self.cohort_f)[g] \
            * self.slot_factor[occ] * _bathtub(self.age[g]) * reinstall
        for s in occ[rng.random(len(occ)) < h]:
            self.fail(int(s), day)
        soft = (0.4 / 365.0) * fr**1.5 * self.slot_factor[occ] ** 0.5
        for s in occ[rng.random(len(occ)) < soft]:
            if self.occupant[s] >= 0:
                self.emit(int(self.occupant[s]), day + float(rng.uniform(0, 1)),
                          str(rng.choice(_SOFT)))
        self.close_racks(day)
        self.move(day, occ)

    def close_racks(self, day: float) -> None:
        for s in np.nonzero((self.slot_close <= day) & (self.occupant >= 0))[0]:
            self.emit(int(self.occupant[s]), day, "retire")
            self.occupant[s] = -1
        self.refill_at[self.slot_close <= day] = np.inf

    def move(self, day: float, occ: np.ndarray) -> None:
        """Swap a few pairs of GPUs between slots (rebalancing)."""
        n = self.rng.poisson(self.p.moves_per_gpu_year / 365.0 * len(occ) / 2)
        for _ in range(n):
            a, b = (int(x) for x in self.rng.choice(occ, 2, replace=False))
            ga, gb = int(self.occupant[a]), int(self.occupant[b])
            if ga < 0 or gb < 0:
                continue
            self.occupant[a], self.occupant[b] = gb, ga
            self.stint_start[a] = self.stint_start[b] = day
            self.emit(gb, day + 0.5, "move", self.location[a])
            self.emit(ga, day + 0.5, "move", self.location[b])


def simulate_life(params: LifeParams | None = None) -> pd.DataFrame:
    """Events ``gpu_id, event_time, event_type, location, cohort`` of a fleet's life,
    sorted by time (the format :func:`forewarn.models.lemon.read_events` reads)."""
    p = params or LifeParams()
    fleet = _Fleet(p, np.random.default_rng(p.seed))
    for day in range(int(p.years * 365)):
        fleet.step(float(day))
    df = pd.DataFrame(fleet.rows, columns=["gpu_id", "event_time", "event_type", "location",
                                           "cohort"])
    return df.sort_values(["event_time", "gpu_id"], kind="stable", ignore_index=True)
