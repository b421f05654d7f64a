"""A GPU of a simulated fleet whose failure follows a precursor a small model alarms on:
the model (a skops file, as a user's retrained one) and the telemetry to send, shared by
the predictor tests (one collector, and replicas on the bus)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from forewarn.models.features import FEATURE_NAMES, gpu_features
from forewarn.models.fleetsim import FleetData, load_params, simulate_fleet
from forewarn.models.persist import save_model
from forewarn.models.predictor import FailurePredictor, fit_table
from forewarn.models.suites import classic
from forewarn.wire import GpuSample, GpuState, NvlinkCounters, RankSummary

from support.collector import NODE

__all__ = ["JOB", "Case", "comparable", "make_case", "ranks", "samples"]

JOB = "train-p"


@dataclasses.dataclass
class Case:
    """A GPU of the simulated fleet that fails after a precursor the model alarms on."""

    data: FleetData
    model_path: Path
    threshold: float
    gpu: int
    fail_time: float
    first_alarm: float
    start: float
    gpus: list[int]


def _fit_model(d: FleetData, path: Path) -> FailurePredictor:
    from sklearn.ensemble import HistGradientBoostingClassifier

    f = gpu_features(d.samples, d.xids)
    fit = fit_table(f, d.labels, 3600.0, neg_stride=10)
    clf = HistGradientBoostingClassifier(max_iter=30, random_state=0)
    clf.fit(fit[list(FEATURE_NAMES)].to_numpy(), fit["y"].to_numpy())
    model = FailurePredictor(classifier=clf, horizon_s=3600.0, threshold=0.5)
    save_model(model, path)
    return model


def _sent(df: pd.DataFrame, gpus: list[int], start: float) -> pd.DataFrame:
    """The rows of ``df`` the test sends: these GPUs of the node, from ``start``."""
    out: pd.DataFrame = df[(df.node == NODE) & df.gpu.isin(gpus) & (df.time >= start)]
    return out


def _case(d: FleetData, model: FailurePredictor, model_path: Path) -> Case | None:
    """The first failure with a precursor that the model alarms on at least 2 minutes ahead,
    within the (up to) three hours of telemetry the test sends. The batch features are
    computed from exactly that telemetry (the failing GPU and its quiet neighbours from
    the window's start): features compare a GPU with its own history and its node peers,
    so they depend on what the collector was sent."""
    labels = d.labels[d.labels["had_precursor"] & (d.labels["node"] == NODE)]
    sim_start = float(d.samples["time"].min())
    for lab in labels.sort_values("time").itertuples():
        start = max(sim_start, lab.time - 180 * 60)
        # neighbours that do not fail anywhere near the window (one failure to score)
        near = d.labels[(d.labels.node == NODE) & (d.labels.time > start - 3600)
                        & (d.labels.time < lab.time + 3 * 3600)]
        quiet = [g for g in range(8) if g != lab.gpu and g not in set(near.gpu)][:3]
        gpus = [int(lab.gpu), *quiet]

        scored = model.score(gpu_features(_sent(d.samples, gpus, start),
                                          _sent(d.xids, gpus, start)))
        mine = scored[scored.gpu == lab.gpu]
        alarms = mine[(mine.p >= model.threshold) & (mine.time >= comparable(start, d))
                      & (mine.time <= lab.time - 120)]
        if alarms.empty:
            continue
        return Case(d, model_path, model.threshold, int(lab.gpu), float(lab.time),
                    float(alarms.time.min()), start, gpus)
    return None


def comparable(start: float, d: FleetData) -> float:
    """From when live features started at ``start`` equal the batch features."""
    return start if start == float(d.samples["time"].min()) else start + 61 * 60


def samples(rows: pd.DataFrame) -> list[GpuSample]:
    """The GPU samples of simulated telemetry ``rows`` as the node's agent sends them."""
    keys = ("gpu", "uuid", "time", "temperature_c", "slowdown_margin_c", "power_w",
            "power_limit_w", "throttle_reasons", "ecc_corrected_volatile",
            "ecc_uncorrected_volatile", "remapped_rows_correctable",
            "remapped_rows_uncorrectable", "remap_pending", "remap_failure",
            "retired_pages_sbe", "retired_pages_dbe", "pcie_replay_total", "pcie_link_width",
            "pcie_link_width_max")
    out = []
    for r in rows.to_dict("records"):
        kw = {k: (r[k].item() if hasattr(r[k], "item") else r[k]) for k in keys}
        links = tuple(NvlinkCounters(link=k, crc_flit=int(r[f"nvlink{k}_crc_flit"]),
                                     replay=int(r[f"nvlink{k}_replay"])) for k in range(4))
        out.append(GpuSample(node=NODE, source="sim", simulated=True,
                             state=GpuState(str(r["state"])), nvlink=links, **kw))
    return out


def make_case(folder: Path) -> Case:
    """Simulate the fleet, fit the model into ``folder`` and find the case (about 2 s)."""
    p = classic(load_params()).replace(nodes=1, gpus_per_node=8, days=2.0, seed=11,
                                       rate_per_1000_gpu_days=1500.0)
    d = simulate_fleet(p)
    path = folder / "retrained.skops"
    c = _case(d, _fit_model(d, path), path)
    assert c is not None, "the fitted model alarms on none of the simulated failures"
    return c


def ranks(gpus: list[int], now: float) -> list[RankSummary]:
    """The job on the node's GPUs, last checkpointed an hour ago (work at risk)."""
    return [RankSummary(job=JOB, rank=i, world_size=len(gpus), node=NODE, gpu=g, pid=100 + i,
                        last_step=int(now - 1.7e9), last_step_time=now, step_seconds_p50=1.0,
                        last_checkpoint_step=1, last_checkpoint_time=now - 3600,
                        checkpoint_seconds=30.0) for i, g in enumerate(gpus)]
