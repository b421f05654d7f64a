"""One GPU sample folded into the live scorer's state row.

A row holds what one row of :func:`forewarn.models.features.grid_state` holds for a GPU:
counters as NVML reports them (the latest value), running sums of gauges and of sample
counts, and the latest values of :data:`~forewarn.models.features.LAST_COLUMNS`.
:func:`fold_sample` adds one sample the way ``grid_state`` folds a minute's samples, so the
live scorer's features equal the batch features a model was trained on.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from forewarn.gpu import POWER_BITS, THERMAL_BITS
from forewarn.models.features import CUM_COLUMNS, LAST_COLUMNS
from forewarn.wire import GpuSample

__all__ = ["COLS", "IX", "N_CUM", "fold_sample"]

COLS: Final = CUM_COLUMNS + LAST_COLUMNS
"""Columns of a state row: the cumulative ones first, then the latest values."""
IX: Final = {c: i for i, c in enumerate(COLS)}
N_CUM: Final = len(CUM_COLUMNS)

_COUNTERS: Final = (
    (IX["ecc"], "ecc_corrected_volatile", False),
    (IX["ecc_unc"], "ecc_uncorrected_volatile", True),
    (IX["remap_c"], "remapped_rows_correctable", False),
    (IX["remap_u"], "remapped_rows_uncorrectable", True),
    (IX["ret_sbe"], "retired_pages_sbe", False),
    (IX["ret_dbe"], "retired_pages_dbe", True),
    (IX["pcie"], "pcie_replay_total", False),
)
"""(column, GpuSample field, whether growth is a failure: an uncorrectable error)."""
_LINKS: Final = ((IX["nvl_crc"], ("crc_flit", "crc_data")), (IX["nvl_replay"], ("replay",)),
                 (IX["nvl_recovery"], ("recovery",)))
"""(column, the NvlinkCounters fields summed into it), as
:func:`~forewarn.models.schema.nvlink_sums` sums the table's columns."""


def _counters(row: np.ndarray, s: GpuSample) -> bool:
    """Counters to their latest value; True when an uncorrectable one grew."""
    grew = False
    for j, field, fatal in _COUNTERS:
        val = getattr(s, field)
        if val is not None:
            grew = grew or (fatal and val > row[j])
            row[j] = val
    for j, fields in _LINKS:  # summed over the links; on none of them: not known, held
        got = [v for lk in s.nvlink for f in fields if (v := getattr(lk, f)) is not None]
        if got:
            row[j] = sum(got)
    return grew


def _gauges(row: np.ndarray, s: GpuSample) -> None:
    """Running sums of the gauges (a sample counts when it has temperature or power; one
    without a temperature or margin at the GPU's last) and their latest values."""
    t, p, m = s.temperature_c, s.power_w, s.slowdown_margin_c
    counted = t is not None or p is not None
    if t is not None:
        row[IX["temp_last"]] = t
    if m is not None:
        row[IX["margin_last"]] = m
    if counted:
        row[IX["n"]] += 1
        t = row[IX["temp_last"]]
        row[IX["temp"]] += t
        row[IX["temp2"]] += t * t
    if m is not None or counted:
        row[IX["margin"]] += row[IX["margin_last"]]
    if p is not None:
        row[IX["power"]] += p
        row[IX["power2"]] += p * p
    if s.power_limit_w is not None:
        row[IX["limit_last"]] = s.power_limit_w
    thr = s.throttle_reasons or 0
    row[IX["thr_thermal"]] += (thr & THERMAL_BITS) != 0
    row[IX["thr_power"]] += (thr & POWER_BITS) != 0
    row[IX["pending"]] += bool(s.remap_pending)


def _link_width(row: np.ndarray, s: GpuSample, started: bool) -> None:
    """PCIe link width as a share of its maximum (a GPU that never says: full width)."""
    if s.pcie_link_width is not None and s.pcie_link_width_max:
        row[IX["width_ratio"]] = s.pcie_link_width / s.pcie_link_width_max
    elif not started:
        row[IX["width_ratio"]] = 1.0


def fold_sample(row: np.ndarray, s: GpuSample, started: bool) -> bool:
    """Add sample ``s`` to the GPU's state ``row`` (``started``: the GPU has a sample
    before this one). True when an uncorrectable counter (ECC, row remaps, retired pages)
    grew on a started GPU: a failure."""
    grew = _counters(row, s)
    _gauges(row, s)
    _link_width(row, s, started)
    return grew and started
