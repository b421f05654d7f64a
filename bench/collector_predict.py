"""Scoring cost of the collector's live failure predictor (forewarn.collector.decide.predict).

Feeds a simulated fleet of N GPUs through :class:`PredictorService` exactly as the policy
thread does (agent batches of one sample per GPU, thinned to ``predict_sample_s``), then
times the scoring of every GPU (one ``score`` call: vectorised features + one
``predict_proba``) and the sample intake, single-threaded (OMP_NUM_THREADS=1).

Usage: ``OMP_NUM_THREADS=1 python bench/collector_predict.py [--gpus 20000] [--model PATH]``
(default model: the shipped one; without it a small model is fitted on a simulated fleet).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from forewarn.collector.decide.predict import PredictorService
from forewarn.models.persist import default_model_path, load_model
from forewarn.wire import AgentBatch, GpuSample, NvlinkCounters


def _model(path: str | None) -> object:
    if path:
        return load_model(path)
    if default_model_path().exists():
        return load_model(default_model_path())
    from sklearn.ensemble import HistGradientBoostingClassifier

    from forewarn.models.features import FEATURE_NAMES, gpu_features
    from forewarn.models.fleetsim import load_params, simulate_fleet
    from forewarn.models.predictor import FailurePredictor, fit_table

    d = simulate_fleet(load_params().replace(nodes=2, days=2.0, seed=11,
                                             rate_per_1000_gpu_days=1500.0))
    fit = fit_table(gpu_features(d.samples, d.xids), d.labels, 3600.0, neg_stride=10)
    clf = HistGradientBoostingClassifier(max_iter=150, random_state=0)
    clf.fit(fit[list(FEATURE_NAMES)].to_numpy(), fit["y"].to_numpy())
    return FailurePredictor(classifier=clf, threshold=0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=20_000)
    ap.add_argument("--model")
    ap.add_argument("--minutes", type=int, default=6, help="simulated minutes fed")
    ap.add_argument("--rate", type=float, default=1.0, help="samples per GPU per second")
    args = ap.parse_args()
    svc = PredictorService(_model(args.model), interval_s=10.0, sample_s=10.0)  # type: ignore[arg-type]
    n, t0 = args.gpus, 1_800_000_000.0
    links = tuple(NvlinkCounters(link=k, crc_flit=0, replay=0) for k in range(4))
    step = 1.0 / args.rate
    intake, scores, fed_total, offered = 0.0, [], 0, 0
    t = t0
    while t < t0 + 60 * args.minutes:
        batch = AgentBatch(node="bench", agent_id="a", seq=0, created=t, samples=[
            GpuSample(node=f"n{i // 8}", gpu=i % 8, time=t, source="sim", simulated=True,
                      temperature_c=60.0 + (i % 7), power_w=300.0, power_limit_w=700.0,
                      slowdown_margin_c=20.0, throttle_reasons=0,
                      ecc_corrected_volatile=int(t - t0) // 600, pcie_replay_total=0,
                      nvlink=links) for i in range(n)])
        offered += n
        start = time.process_time()
        svc.observe([batch])
        intake += time.process_time() - start
        if svc.due(t):
            start = time.process_time()
            svc.score(t)
            if t - t0 >= 120:
                scores.append(time.process_time() - start)
        t += step if args.rate >= 1 else 10.0
    fed_total = svc.samples["fed"]
    sim_s = t - t0
    score_s = statistics.median(scores)
    print(f"GPUs: {n}, simulated {sim_s:.0f} s at {args.rate:g} sample/GPU/s "
          f"(fed {fed_total} of {offered} samples; thinning to one per 10 s)")
    print(f"scoring all GPUs: median {score_s * 1e3:.1f} ms CPU "
          f"({score_s / n * 1e6:.2f} us per GPU), every 10 s = "
          f"{100 * score_s / 10:.2f}% of one core")
    print(f"sample intake: {intake / sim_s * 1e3:.1f} ms CPU per second "
          f"({intake / offered * 1e6:.2f} us per offered sample, "
          f"{intake / max(1, fed_total) * 1e6:.1f} us per fed sample) = "
          f"{100 * intake / sim_s:.2f}% of one core")
    print(f"total: {100 * (intake / sim_s + score_s / 10):.1f}% of one core; "
          f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
