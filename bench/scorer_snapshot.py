"""Cost of keeping the live scorer's learned state in the store
(forewarn.collector.decide.scorer_state, forewarn.models.live_state).

Feeds N GPUs (nodes of 8, one sample a minute, noisy gauges, a correctable-ECC trickle on
a third of them) for ``--minutes`` into a :class:`LiveScorer`, then times, each ``--repeat``
times (median):

* capture: copying the scorer's arrays -- the only part on the policy thread;
* encode: the compressed ``.npz`` -- on the snapshot writer's thread;
* write: the upsert of the row into a real SQLite store (WAL, synchronous FULL) -- writer
  thread;
* read + restore: reading the row and restoring a new scorer from it (at start/takeover).

Usage: ``python bench/scorer_snapshot.py [--gpus 20000] [--minutes 30]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from forewarn.collector.decide.scorer_state import ScorerSnapshots
from forewarn.collector.storage.store import Store
from forewarn.models.features import GRID_S
from forewarn.models.live import LiveScorer
from forewarn.models.live_state import Captured, capture, encode
from forewarn.models.predictor import FailurePredictor
from forewarn.wire import GpuSample


class _Zero:
    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(x)), np.zeros(len(x))])


def _fed(n: int, minutes: int, t0: float) -> LiveScorer:
    scorer = LiveScorer(FailurePredictor(classifier=_Zero()))
    rng = np.random.default_rng(0)
    for m in range(minutes):
        temps = 55.0 + rng.normal(0, 2, n)
        power = 400.0 + rng.normal(0, 30, n)
        for i in range(n):
            scorer.observe(GpuSample(
                node=f"node{i // 8:05d}", gpu=i % 8, time=t0 + m * GRID_S + 1, source="sim",
                temperature_c=float(temps[i]), power_w=float(power[i]), power_limit_w=700.0,
                slowdown_margin_c=20.0, ecc_corrected_volatile=m * 3 if i % 3 == 0 else 0,
                pcie_replay_total=0))
    return scorer


_CPU: dict[str, float] = {}
"""Median CPU seconds (process time) of each timed step, by name."""


def _timed(name: str, fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median wall seconds of ``fn`` (its CPU seconds into :data:`_CPU`) and its result."""
    times, cpu, out = [], [], None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    _CPU[name] = statistics.median(cpu)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=20_000)
    ap.add_argument("--minutes", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    t0 = 1_800_000_000.0
    now = t0 + args.minutes * GRID_S
    scorer = _fed(args.gpus, args.minutes, t0)
    cap_s, captured = _timed("capture", lambda: capture(scorer, now), args.repeat)
    assert isinstance(captured, Captured)
    enc_s, blob = _timed("encode", lambda: encode(captured), args.repeat)
    assert isinstance(blob, bytes)
    raw = sum(a.nbytes for a in captured.arrays.values())
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "collector.db")
        snaps = ScorerSnapshots(store)

        def write() -> None:
            snaps._write(captured)

        write_s, _ = _timed("write", write, args.repeat)
        rows = store.scalar("SELECT COUNT(*) FROM scorer_state")

        def load() -> LiveScorer:
            back = LiveScorer(scorer.model)
            assert snaps.load(back, now)
            return back

        load_s, back = _timed("load", load, args.repeat)
        assert isinstance(back, LiveScorer) and back.gpus == args.gpus
        snaps.close()
        store.close()
    print(f"GPUs: {args.gpus}, {args.minutes} minutes fed; state arrays {raw / 2**20:.1f} MiB "
          f"({raw / args.gpus:.0f} B per GPU), snapshot {len(blob) / 2**20:.1f} MiB "
          f"compressed; {rows} row in scorer_state after {args.repeat} writes")
    print(f"policy thread (capture): {cap_s * 1e3:.1f} ms wall, {_CPU['capture'] * 1e3:.1f} ms "
          "CPU")
    print(f"writer thread: encode {enc_s * 1e3:.0f} ms wall ({_CPU['encode'] * 1e3:.0f} CPU) "
          f"+ SQLite write {write_s * 1e3:.0f} ms wall ({_CPU['write'] * 1e3:.0f} CPU)")
    print(f"start/takeover: read + restore {load_s * 1e3:.0f} ms wall "
          f"({_CPU['load'] * 1e3:.0f} CPU)")


if __name__ == "__main__":
    main()
