"""Benchmark: failure-predictor scoring cost on one core, and training time.

Goal (issue 17): score a 100,000-GPU fleet every 10 s (the collector's
``predict_interval_s``) using under 10% of one core: the CPU time of the six scorings of
a minute under 6 s. The first scoring of a minute computes every GPU's features and
probability; the later ones reuse them (features change once a minute). Every GPU runs in
a job of 32 (4 nodes x 8), and each scoring compares it with its job peers as the
collector does (``LiveScorer.job_findings``).

Run: ``python bench/models_score.py [--gpus 20000] [--model PATH] [--train-nodes 8]``.
Pins itself to one CPU and one OpenMP thread so the figures are per core.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy/sklearn load their pools

import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from forewarn.wire import GpuSample, NvlinkCounters


def _samples(n: int, t: float, rng: np.random.Generator, base: dict[str, np.ndarray]
             ) -> list[GpuSample]:

    base["ecc"] += rng.poisson(0.01, n)
    temp = 60 + rng.normal(0, 2, n)
    out = []
    for i in range(n):
        out.append(GpuSample(
            node=f"node{i // 8:05d}", gpu=i % 8, time=t, source="bench",
            temperature_c=float(temp[i]), slowdown_margin_c=float(87 - temp[i]),
            power_w=600.0, power_limit_w=700.0, throttle_reasons=0,
            ecc_corrected_volatile=int(base["ecc"][i]), ecc_uncorrected_volatile=0,
            remapped_rows_correctable=0, remapped_rows_uncorrectable=0, remap_pending=False,
            pcie_replay_total=0, pcie_link_width=16, pcie_link_width_max=16,
            nvlink=(NvlinkCounters(link=0, crc_flit=0, replay=0),)))
    return out


def bench_scoring(model_path: str | None, gpus: int, minutes: int,
                  interval_s: float = 10.0) -> dict[str, float]:
    """Feed one sample per GPU a minute and score every ``interval_s`` as the collector
    does (``predict_interval_s``); CPU time of the first scoring in each minute and of
    the ones after it, and their share of one core."""
    from forewarn.models.live import LiveScorer
    from forewarn.models.persist import load_default_model, load_model

    model = load_model(model_path) if model_path else load_default_model()
    scorer = LiveScorer(model, capacity=gpus)
    rng = np.random.default_rng(0)
    base = {"ecc": np.zeros(gpus, np.int64)}
    t0 = 1_767_225_600.0
    calls = int(60 // interval_s)
    observe_s, first_s, later_s, minute_s, peers_s = 0.0, [], [], [], []
    findings: Sequence[object] = []
    for m in range(minutes):
        batch = _samples(gpus, t0 + m * 60 + 5, rng, base)
        s = time.process_time()
        for sample in batch:
            scorer.observe(sample)
        observe_s += time.process_time() - s
        for sample in batch:  # the rank summaries' job map (not timed: the collector's)
            scorer.assign_job(sample.node, sample.gpu, f"job{int(sample.node[4:]) // 4}",
                              sample.time)
        took = []
        for k in range(calls):
            s = time.process_time()
            now = t0 + (m + 1) * 60 + 1 + k * interval_s
            findings = scorer.score(now)
            p = time.process_time()
            findings = [*findings, *scorer.job_findings(now)]
            took.append(time.process_time() - s)
            if k == 0 and m:
                peers_s.append(time.process_time() - p)
        if m:  # the first minute warms up (no GPU has a full window yet)
            first_s.append(took[0])
            later_s += took[1:]
            minute_s.append(sum(took))
    per_minute = float(np.median(minute_s))
    return {
        "gpus": gpus, "scoring_interval_s": interval_s,
        "score_first_in_minute_seconds_median": round(float(np.median(first_s)), 4),
        "score_later_in_minute_seconds_median": round(float(np.median(later_s)), 4)
        if later_s else 0.0,
        "job_peers_of_first_scoring_seconds_median": round(float(np.median(peers_s)), 4),
        "cpu_share_scoring_every_10s": round(per_minute / 60.0, 4),
        "observe_us_per_sample": round(observe_s / (gpus * minutes) * 1e6, 2),
        "cpu_share_observe_one_sample_per_gpu_per_10s":
            round(observe_s / (gpus * minutes) * gpus / 10.0, 4),
        "findings_last_call": len(findings),
        "scorer_state_mib": round(_held_bytes(scorer) / 2**20, 1),
    }


def _held_bytes(scorer: Any) -> int:
    """Bytes of every array the scorer holds between scorings: its state and the minute's
    cached features and probabilities."""
    arrays = [a for a in vars(scorer).values() if isinstance(a, np.ndarray)]
    cache = scorer._scores
    if cache is not None:
        arrays += [cache.slots, cache.probs, *cache.feats.values()]
    return sum(int(a.nbytes) for a in arrays)


def bench_training(nodes: int, days: float) -> dict[str, float]:
    from forewarn.models.features import gpu_features
    from forewarn.models.fleetsim import load_params, simulate_fleet
    from forewarn.models.predictor import train_predictor

    p = load_params().replace(nodes=nodes, days=days, seed=77)
    s = time.process_time()
    d = simulate_fleet(p)
    sim_s = time.process_time() - s
    s = time.process_time()
    feats = gpu_features(d.samples, d.xids)
    feat_s = time.process_time() - s
    s = time.process_time()
    model = train_predictor([(feats, d.labels)])
    train_s = time.process_time() - s
    return {"gpu_days": p.gpu_days, "samples": len(d.samples), "failures": len(d.labels),
            "simulate_cpu_s": round(sim_s, 2), "features_cpu_s": round(feat_s, 2),
            "features_rows_per_s": round(len(d.samples) / feat_s),
            "train_cpu_s": round(train_s, 2), "train_rows": model.metadata["train_rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=20_000)
    ap.add_argument("--minutes", type=int, default=4,
                    help="minutes of samples (scored every 10 s)")
    ap.add_argument("--model", help="model file (default: the shipped model)")
    ap.add_argument("--train-nodes", type=int, default=8)
    ap.add_argument("--train-days", type=float, default=7.0)
    ap.add_argument("--skip-training", action="store_true")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    out = {"scoring": bench_scoring(args.model, args.gpus, args.minutes)}
    if not args.skip_training:
        out["training"] = bench_training(args.train_nodes, args.train_days)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
