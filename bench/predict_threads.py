"""Wall time of the collector's scoring on a busy host: ``predict_threads = 1`` against the
OpenMP default (one thread per core).

Feeds N GPUs minute by minute through :class:`PredictorService` (as the policy thread does)
and times every scoring's wall clock (a new minute each, so features and ``predict_proba``
run each time), first on an idle host, then with a busy-loop process on every core. The
model is ``--detector model``'s (calibrated HistGradientBoosting, 150 iterations) fitted
on a simulated fleet, or ``--model PATH``.

Usage: ``python bench/predict_threads.py [--gpus 4000] [--minutes 8] [--model PATH]``.
Do not set ``OMP_NUM_THREADS``: the default thread count is what is measured.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from typing import Any

from forewarn.collector.decide.predict import PredictorService
from forewarn.models.persist import load_model
from forewarn.wire import AgentBatch, GpuSample, NvlinkCounters


def _model(path: str | None) -> Any:
    """``--model PATH``, else the gradient-boosted predictor ``forewarn models train
    --detector model`` fits, on a simulated fleet."""
    if path:
        return load_model(path)
    from forewarn.models.features import gpu_features
    from forewarn.models.fleetsim import load_params, simulate_fleet
    from forewarn.models.predictor import train_predictor

    d = simulate_fleet(load_params().replace(nodes=2, days=2.0, seed=11,
                                             rate_per_1000_gpu_days=1500.0))
    return train_predictor([(gpu_features(d.samples, d.xids), d.labels)], threshold=0.5)


def _spin() -> None:
    while True:
        pass


def _scorings(model: Any, gpus: int, minutes: int, threads: int) -> list[float]:
    """Wall seconds of each scoring after the first two minutes."""
    svc = PredictorService(model, sample_s=0.0, threads=threads)
    links = tuple(NvlinkCounters(link=k, crc_flit=0, replay=0) for k in range(4))
    t0, out = 1_800_000_000.0, []
    for m in range(minutes):
        t = t0 + 60.0 * m
        svc.observe([AgentBatch(node="bench", agent_id="a", seq=m, created=t, samples=[
            GpuSample(node=f"n{i // 8}", gpu=i % 8, time=t, source="sim", simulated=True,
                      temperature_c=60.0 + (i % 7), power_w=300.0, power_limit_w=700.0,
                      slowdown_margin_c=20.0, throttle_reasons=0,
                      ecc_corrected_volatile=m // 10, pcie_replay_total=0, nvlink=links)
            for i in range(gpus)])])
        start = time.perf_counter()
        svc.score(t + 61.0)
        if m >= 2:
            out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=4000)
    ap.add_argument("--minutes", type=int, default=8)
    ap.add_argument("--model")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    model = _model(args.model)
    print(f"{args.gpus} GPUs, {cores} cores; wall seconds per scoring (median, max)")
    for load in ("idle", "busy"):
        spinners = [multiprocessing.Process(target=_spin, daemon=True)
                    for _ in range(cores if load == "busy" else 0)]
        for p in spinners:
            p.start()
        try:
            for threads in (cores, 1):
                s = _scorings(model, args.gpus, args.minutes, threads)
                print(f"{load:4}  threads={threads:<3} median {statistics.median(s):.3f}  "
                      f"max {max(s):.3f}  ({len(s)} scorings)", flush=True)
        finally:
            for p in spinners:
                p.terminate()
                p.join()


if __name__ == "__main__":
    main()
