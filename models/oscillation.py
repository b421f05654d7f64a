"""A gauge oscillating with a period, against the node's peers: fan or controller hunting.

Helper of :func:`forewarn.models.features.derive`. A fan or its controller hunting makes a
GPU's temperature swing up and down with a period of minutes (issue 17: thermal/fan
oscillation was missed). What tells it from benign behaviour is that it *repeats*:

* a workload's change (a job starting, a phase, a checkpoint) moves every GPU of the node
  together, so it reads zero against the peers;
* a hot spell or a creep is a smooth rise (and fall) over tens of minutes: a straight line
  fitted over the window takes most of it, and what is left has little energy at periods
  of a few minutes;
* noise does not keep one period: over half an hour its energy spreads over all of them.

So over the last :data:`WINDOW` minutes the GPU's per-minute mean temperature, less a
straight line fitted to it, is projected on sinusoids of each of :data:`FREQUENCIES`
(a detrended Fourier coefficient, in degrees of amplitude). The node's median coefficient
of each frequency (real and imaginary parts, a linear quantity, so a shared swing cancels
exactly) is taken off, and the feature is the largest amplitude left over the periods:
``temp_osc_vs_peers``, in C. It reads zero for a GPU whose window is not
:data:`COVERAGE` covered by minutes with samples (a gap bends the fit) and for one with
fewer than two such peers (nothing to compare with).

The per-minute means come from the cumulative grid (sums and sample counts) at every lag
of the window, which the batch features index on the grid and the live scorer reads from
its ring of the last hour: the same numbers in both (:data:`HISTORY_COLUMNS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import numpy as np

from forewarn.models.gauges import peer_deviation

__all__ = ["COVERAGE", "FREQUENCIES", "HISTORY_COLUMNS", "WINDOW", "History",
           "oscillation_vs_peers"]

WINDOW: Final = 30
"""Minutes of history the oscillation is measured over: two to seven periods."""
FREQUENCIES: Final = tuple(j / (2 * WINDOW) for j in range(4, 16))
"""Frequencies (cycles a minute) projected on: periods of 4 to 15 minutes, half a cycle per
window apart, so that a swing of any period between them loses at most a tenth of its
amplitude (a grid of a cycle per window apart lost up to 42 %). A fan hunting swings in
minutes; at 60 s samples a period under 4 minutes is too few samples per cycle, and one
over 15 is a workload's pace, which a straight line over half an hour partly takes."""
COVERAGE: Final = 0.9
"""Share of the window's minutes that must hold samples."""
HISTORY_COLUMNS: Final = ("n", "temp")
"""The cumulative grid columns the oscillation reads at each lag."""

History = Callable[[int], Mapping[str, np.ndarray]]
"""``history(k)``: the cumulative grid row ``k`` minutes back (0: now) of every row,
columns :data:`HISTORY_COLUMNS`; before the GPU's first row, its first row."""


def _coefficients(history: History, gauge: str) -> tuple[np.ndarray, np.ndarray]:
    """(complex amplitudes, frequencies x rows; covered rows) of the per-minute means of
    ``gauge`` over the window less their least-squares line."""
    upper = history(0)
    size = len(upper["n"])
    sums = np.zeros((5, size))  # sum h, h*t, h*t^2, h*x, h*x*t over present minutes
    proj = np.zeros((3, len(FREQUENCIES), size), complex)  # sum h*x*e, h*e, h*t*e
    for k in range(WINDOW):
        lower = history(k + 1)
        dn = upper["n"] - lower["n"]
        h = dn > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            x = np.where(h, (upper[gauge] - lower[gauge]) / dn, 0.0)
        hf = h.astype(np.float64)
        sums += np.array([hf, hf * k, hf * k * k, hf * x, hf * x * k])
        e = np.exp(-2j * np.pi * k * np.asarray(FREQUENCIES))[:, None]
        proj[0] += e * (hf * x)
        proj[1] += e * hf
        proj[2] += e * (hf * k)
        upper = lower
    s0, s1, s2, sx, sxt = sums
    det = s0 * s2 - s1 * s1
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(det > 0, (s0 * sxt - s1 * sx) / det, 0.0)
        level = np.where(s0 > 0, (sx - slope * s1) / s0, 0.0)
    covered = s0 >= COVERAGE * WINDOW
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.where(covered, 2.0 / s0, 0.0)
    coef = (proj[0] - level * proj[1] - slope * proj[2]) * scale
    return coef, covered


def oscillation_vs_peers(history: History, group: np.ndarray | None,
                         gauge: str = "temp") -> np.ndarray:
    """``<gauge>_osc_vs_peers`` of every row (module docstring); ``group`` as in
    :func:`~forewarn.models.gauges.peer_deviation` (None: zeros)."""
    coef, covered = _coefficients(history, gauge)
    if group is None:
        return np.zeros(len(covered))
    parts = {f"{p}{j}": getattr(coef[j], p) for j in range(len(FREQUENCIES))
             for p in ("real", "imag")}
    dev = peer_deviation(parts, np.where(covered, group, -1))
    amp = np.zeros(len(covered))
    for j in range(len(FREQUENCIES)):
        amp = np.maximum(amp, np.hypot(dev[f"real{j}"], dev[f"imag{j}"]))
    return amp
