"""Why a GPU alarmed: the signals that stand out, against its own baseline and its peers.

Each signal (:data:`SIGNALS`) has a feature that measures it against the GPU's own
long-run behaviour and one against its node peers at the same time
(:mod:`forewarn.models.features`). A signal's weight for one GPU is how far those two
values sit from the fleet's at the same scoring, in robust standard deviations (median and
MAD over a sample of the fleet, floored so that a fleet where everyone reads zero does not
turn a small value into a huge one). :func:`explain` names the top signals with both
values in their units; the live scorer puts it into each alarm's evidence, so findings,
the status page and webhooks carry it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import numpy as np

__all__ = ["SIGNALS", "explain"]

SIGNALS: Final = {
    # name: (feature vs own baseline, feature vs node peers, unit of both, floor of scale)
    "correctable ECC": ("ecc_d15", "ecc_vs_peers", "log1p(errors in 15 min beyond own)", 0.5),
    "row remaps": ("remap_c_d60", "remap_c_vs_peers", "log1p(remaps in 1 h)", 0.5),
    "retired pages": ("ret_sbe_d60", "ret_sbe_vs_peers", "log1p(pages in 1 h)", 0.5),
    "PCIe replays": ("pcie_d15", "pcie_vs_peers", "log1p(replays in 15 min beyond own)", 0.5),
    "NVLink CRC": ("nvl_crc_d15", "nvl_crc_vs_peers", "log1p(errors in 15 min beyond own)",
                   0.5),
    "NVLink replays": ("nvl_replay_d15", "nvl_replay_vs_peers", "log1p(replays in 15 min)",
                       0.5),
    "NVLink recovery": ("nvl_recovery_d15", "nvl_recovery_vs_peers",
                        "log1p(recoveries in 15 min)", 0.5),
    "temperature": ("temp_vs_own", "temp_vs_peers", "C", 2.0),
    "temperature swings": ("temp_std_vs_own", "temp_std_vs_peers", "C (std, 15 min)", 1.0),
    "power": ("power_vs_own", "power_vs_peers", "share of the power limit", 0.05),
    "power noise": ("power_std_vs_own", "power_std_vs_peers",
                    "share of the power limit (std, 15 min)", 0.02),
    "thermal throttling": ("thr_thermal_vs_own", "thr_thermal_vs_peers", "share of samples",
                           0.1),
    "power capping": ("thr_power_vs_own", "thr_power_vs_peers", "share of samples", 0.1),
    "pending row remap": ("pending_vs_own", "pending_vs_peers", "share of samples", 0.1),
    "missing samples": ("samples_vs_own", "samples_vs_peers", "sample rate ratio - 1", 0.1),
}
"""The signals an explanation can name."""

_SAMPLE: Final = 4096


def _fleet_scale(x: np.ndarray, floor: float, rng: np.random.Generator
                 ) -> tuple[float, float]:
    s = x if len(x) <= _SAMPLE else rng.choice(x, _SAMPLE, replace=False)
    med = float(np.median(s))
    return med, max(1.4826 * float(np.median(np.abs(s - med))), floor)


def explain(feats: Mapping[str, np.ndarray], rows: np.ndarray, top: int = 3,
            seed: int = 0) -> dict[str, list[str | float]]:
    """For each of ``rows`` (indices into the aligned feature arrays of the whole fleet):
    ``explanation`` (text: the ``top`` signals, strongest first, each with its value vs
    own baseline and vs peers), ``signal`` (the strongest signal's name),
    ``signal_vs_own`` and ``signal_vs_peers`` (its two values). Signals whose features are
    missing from ``feats`` are skipped."""
    rng = np.random.default_rng(seed)
    names: list[str] = []
    weights: list[np.ndarray] = []
    own_v: list[np.ndarray] = []
    peer_v: list[np.ndarray] = []
    for name, (own, peer, _unit, floor) in SIGNALS.items():
        if own not in feats or peer not in feats:
            continue
        w = np.zeros(len(rows))
        for col, vals in ((own, own_v), (peer, peer_v)):
            x = np.asarray(feats[col], dtype=np.float64)
            med, scale = _fleet_scale(x, floor, rng)
            w += np.abs(x[rows] - med) / scale
            vals.append(x[rows])
        names.append(name)
        weights.append(w)
    out: dict[str, list[str | float]] = {"explanation": [], "signal": [],
                                          "signal_vs_own": [], "signal_vs_peers": []}
    if not names:
        return out
    wmat = np.vstack(weights)  # signals x rows
    for j in range(len(rows)):
        order = np.argsort(-wmat[:, j], kind="stable")[:top]
        parts = [f"{names[k]} {own_v[k][j]:+.2f} vs own, {peer_v[k][j]:+.2f} vs peers "
                 f"({SIGNALS[names[k]][2]}; {wmat[k, j]:.1f} robust SD from the fleet)"
                 for k in order if wmat[k, j] > 0]
        best = int(order[0])
        out["explanation"].append("; ".join(parts) or "no single signal stands out")
        out["signal"].append(names[best])
        out["signal_vs_own"].append(round(float(own_v[best][j]), 4))
        out["signal_vs_peers"].append(round(float(peer_v[best][j]), 4))
    return out
