"""The simulated data sets the shipped model is trained and judged on.

Training and held-out suites never share a seed, and the held-out suite uses parameter
values training never saw: precursors half and twice as long, 1.6x the noise, other fleet
sizes (docs/models.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pandas as pd

from forewarn.models.features import gpu_features
from forewarn.models.fleetsim import FleetParams, load_params, simulate_fleet

__all__ = ["CLASSIC_FAMILIES", "classic", "heldout_suite", "simulate_features", "train_suite",
           "tune_params"]


def train_suite(base: FleetParams | None = None, scale: float = 1.0) -> list[FleetParams]:
    """Training fleets: seeds 101 and 102, precursor scale 1.0 and 0.8, noise 1.0 and 1.2;
    4 days each at 250 failures per 1,000 GPU-days with every precursor family equally
    likely (rare families such as thermal ones get enough examples to learn from)."""
    p = _training(base)
    nodes = max(1, round(p.nodes * scale))
    return [
        p.replace(seed=101, nodes=nodes, precursor_scale=1.0, noise_scale=1.0),
        p.replace(seed=102, nodes=nodes, precursor_scale=0.8, noise_scale=1.2),
    ]


def _training(base: FleetParams | None) -> FleetParams:
    p = base or load_params()
    return p.replace(days=4.0, rate_per_1000_gpu_days=250.0, balanced_families=True)


def tune_params(base: FleetParams | None = None, scale: float = 1.0) -> FleetParams:
    """The fleet the operating threshold is tuned on (seed 201), like the training
    fleets."""
    p = _training(base)
    return p.replace(seed=201, nodes=max(1, round(p.nodes * scale)))


def heldout_suite(base: FleetParams | None = None, scale: float = 1.0
                  ) -> dict[str, FleetParams]:
    """Held-out fleets: unseen seeds and unseen parameter values."""
    p = base or load_params()
    n = max(1, round(p.nodes * scale))
    return {
        "same_params_new_seed": p.replace(seed=901, nodes=n),
        "short_precursors_x0.5": p.replace(seed=902, nodes=n, precursor_scale=0.5),
        "long_precursors_x2": p.replace(seed=903, nodes=n, precursor_scale=2.0),
        "noise_x1.6": p.replace(seed=904, nodes=n, noise_scale=1.6),
        "fleet_x1.5_10s_samples": p.replace(seed=905, nodes=max(1, round(n * 1.5)),
                                            sample_interval_s=10.0, days=p.days / 4),
    }


CLASSIC_FAMILIES = ("ecc_accel", "sram_bursts", "pcie_accel", "nvlink_one", "thermal_creep",
                    "gsp_power")
"""The precursor families the simulator had before issue 17."""


def classic(p: FleetParams) -> FleetParams:
    """The simulator's world before issue 17's behaviour families: its first six precursor
    families and none of the chronic or node-wide benign behaviour. For tests of the
    training, persistence and live-scoring machinery on small fleets; how a model fares
    on the families is the leave-one-family-out table in docs/models.md."""
    causes = tuple(dataclasses.replace(c, families=tuple(
        f for f in c.families if f in CLASSIC_FAMILIES)) for c in p.causes)
    off = dict.fromkeys(("ecc_trickle", "pcie_creep", "hot_gpu", "telemetry_gaps",
                         "node_event"), 0.0)
    return p.replace(causes=causes, benign=p.benign | off)


def simulate_features(params: FleetParams) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Simulate a fleet and return (features, labels)."""
    d = simulate_fleet(params)
    return gpu_features(d.samples, d.xids), d.labels


def iter_features(suite: dict[str, FleetParams]) -> Iterator[tuple[str, pd.DataFrame,
                                                                   pd.DataFrame]]:
    """(name, features, labels) for each fleet of a suite, one at a time (memory)."""
    for name, params in suite.items():
        f, lab = simulate_features(params)
        yield name, f, lab
