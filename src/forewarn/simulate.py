"""``forewarn simulate``: what forewarn saves on long training runs, by discrete-event simulation.

A job of ``gpus`` GPUs trains for ``days`` of wall time. Failures arrive as a Poisson process
at a per-node rate (8 GPUs a node). Three ways to run it are compared on the same failures:

(a) ``baseline``: periodic checkpoints at Daly's optimum (Young's ``sqrt(2·C·M)`` refined,
    :func:`forewarn.collector.jobs.goodput.daly_interval`, the interval the collector advises);
    a failure is noticed only when NCCL's watchdog fires (10 min, PyTorch's default
    collective timeout).
(b) ``fast_detection``: the same, but the agent notices the stuck ranks within
    ``detect_s`` (forewarn's measured hang-detection latency) and the launcher restarts.
(c) ``proactive``: (b) plus prediction-driven checkpoints: a failure that has a precursor is
    predicted with probability ``recall`` ``lead`` seconds ahead, and a checkpoint is ordered
    then; false alarms (``false_alarms_per_1k_gpu_days``) each cost one checkpoint.
(d) ``gated``: (c)'s alarms, each weighed as the collector's cost-aware policy weighs it
    (:mod:`forewarn.simulate_gate`: the collector's own ``decide_checkpoint``): a checkpoint
    only where the alarm's P x the work since the last checkpoint exceeds the checkpoint's
    cost; a declined prediction is weighed again every 5 minutes (the GPU stays alarmed).

Lost time is broken down as the goodput accounting does: checkpoint overhead, work redone
after failures, detection delay, restart downtime.

``--elastic`` compares, on the same failures, a job that waits for a replacement node before
it restarts at full size with one that shrinks by the failed node and continues (torchrun
elastic), then grows back when the replacement arrives (:func:`simulate_elastic`); its
figure is GPU utilisation: progress made per GPU-second the job holds.

Published figures this must reproduce first (tests/models/test_simulate.py):
- Young's first-order waste at the optimum, ``sqrt(2C/M)`` (checkpoint overhead + rework only).
- Meta's projected job mean time to failure by size (Kokolis et al., HPCA 2025): 1.8 h at
  16,384 GPUs from 6.5 failures per 1,000 node-days (docs/reference.md). Their *measured* 7.9 h at
  1,024 GPUs is shorter than this node-rate model gives (28.8 h): it counts failures this
  projection leaves out, which is why the default rate is the projection's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
from pathlib import Path
from typing import Any

from forewarn.collector.jobs.goodput import daly_interval
from forewarn.simulate_gate import FALSE_ALARM_P, REWEIGH_S, TRUE_ALARM_P, Gate, draw_p, parse_band

__all__ = [
    "Breakdown",
    "ElasticParams",
    "ElasticRun",
    "RunParams",
    "compare_elastic",
    "mttf_hours",
    "register",
    "simulate",
    "simulate_elastic",
    "young_interval",
]

GPUS_PER_NODE = 8
META_FAILURES_PER_1K_NODE_DAYS = 6.5
"""Upper end of Meta's 2.3-6.5 failures per 1,000 node-days (HPCA 2025), which yields their
projected 1.8 h MTTF at 16,384 GPUs."""
MODES = ("baseline", "fast_detection", "proactive", "gated")
"""The ways to run a job that :func:`simulate` compares (module docstring: (a) to (d))."""
NCCL_TIMEOUT_S = 600.0
"""PyTorch's default NCCL collective timeout: how long a hang goes unnoticed without forewarn."""


@dataclasses.dataclass(frozen=True)
class RunParams:
    """One simulated configuration. Times in seconds."""

    gpus: int = 4096
    days: float = 30.0
    failures_per_1k_node_days: float = META_FAILURES_PER_1K_NODE_DAYS
    checkpoint_s: float = 60.0
    """C: wall time the job stalls to take one checkpoint."""
    restart_s: float = 600.0
    """R: rescheduling, process start and checkpoint load after a failure."""
    nccl_timeout_s: float = NCCL_TIMEOUT_S
    detect_s: float = 3.0
    """forewarn's hang detection latency (bench/RESULTS.md)."""
    # Defaults for (c): the shipped predictor's leave-one-family-out figures (README,
    # docs/models.md: trained without a family, tested on it): recall 0.53 on failures with
    # a precursor, median lead 43 min, 6.29 false alarms per 1,000 GPU-days. The share of
    # failures with a precursor (55 %) is the fleet simulator's assumption, not a measurement.
    predictable_share: float = 0.55
    """Share of failures with a precursor a model can see (an assumption; see docs/models.md)."""
    recall: float = 0.53
    lead_median_s: float = 2580.0
    false_alarms_per_1k_gpu_days: float = 6.29
    interval_s: float | None = None
    """Periodic interval; None = Daly's optimum for this C and M."""
    true_alarm_p: tuple[tuple[float, float], ...] = TRUE_ALARM_P
    """(d): P carried by alarms a failure follows, ``(P, share)`` bands."""
    false_alarm_p: tuple[tuple[float, float], ...] = FALSE_ALARM_P
    """(d): P carried by false alarms, ``(P, share)`` bands."""

    @property
    def mtbf_s(self) -> float:
        """M: the job's mean time between failures."""
        nodes = max(1, math.ceil(self.gpus / GPUS_PER_NODE))
        per_node_s = 86400.0 * 1000.0 / self.failures_per_1k_node_days
        return per_node_s / nodes


@dataclasses.dataclass
class Breakdown:
    """Where one run's wall time went (seconds)."""

    wall_s: float = 0.0
    useful_s: float = 0.0
    checkpoint_s: float = 0.0
    rework_s: float = 0.0
    detection_s: float = 0.0
    restart_s: float = 0.0
    failures: int = 0
    alarms: int = 0
    """Alarms raised ((c) and (d): predicted failures and false alarms)."""
    ordered: int = 0
    """Checkpoints ordered on alarms."""

    @property
    def goodput(self) -> float:
        """Effective training time ratio."""
        return self.useful_s / self.wall_s if self.wall_s else 0.0

    def waste(self, *parts: str) -> float:
        return sum(getattr(self, p) for p in parts) / self.wall_s if self.wall_s else 0.0


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2·C·M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def mttf_hours(gpus: int, failures_per_1k_node_days: float = META_FAILURES_PER_1K_NODE_DAYS,
               days: float = 365.0, seed: int = 0) -> float:
    """A job's mean time to failure measured in simulation (hours)."""
    p = RunParams(gpus=gpus, failures_per_1k_node_days=failures_per_1k_node_days)
    rng = random.Random(seed)
    horizon = days * 86400.0
    t, n = 0.0, 0
    while True:
        t += rng.expovariate(1.0 / p.mtbf_s)
        if t > horizon:
            break
        n += 1
    return (horizon / max(n, 1)) / 3600.0


def simulate(p: RunParams, mode: str, seed: int = 0, gate: Gate | None = None) -> Breakdown:
    """Simulate one run in ``mode`` (one of :data:`MODES`); ``gated`` weighs with ``gate``
    (a new one by default), which keeps its decisions."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    gate = (gate or Gate(p.checkpoint_s)) if mode == "gated" else None
    alarms = mode in ("proactive", "gated")
    rng = random.Random(seed)
    horizon = p.days * 86400.0
    mtbf = p.mtbf_s
    interval = p.interval_s or daly_interval(p.checkpoint_s, mtbf)
    # Once a failure is predicted the risk is "within about the lead time": the cost-aware
    # policy checkpoints at once and then at the optimum for that shorter M.
    risk_interval = min(interval, daly_interval(p.checkpoint_s, p.lead_median_s))
    detect = p.nccl_timeout_s if mode == "baseline" else p.detect_s
    b = Breakdown(wall_s=horizon)
    # Failures strike on the wall clock, drawn once per seed: every mode sees the same ones
    # (the alarms' P from a generator of their own, so that drawing it changes nothing else).
    failures = []
    p_rng = random.Random(seed + 2_000_003)
    f = rng.expovariate(1.0 / mtbf)
    while f < horizon:
        has_precursor = rng.random() < p.predictable_share
        predicted = has_precursor and rng.random() < p.recall
        lead = rng.lognormvariate(math.log(p.lead_median_s), 0.75)
        failures.append((f, predicted, lead, draw_p(p_rng, p.true_alarm_p)))
        f += rng.expovariate(1.0 / mtbf)
    fa_rng = random.Random(seed + 1_000_003)
    fa_rate = p.false_alarms_per_1k_gpu_days * p.gpus / 1000.0 / 86400.0
    use_fa = alarms and fa_rate > 0
    next_fa = fa_rng.expovariate(fa_rate) if use_fa else math.inf
    t = 0.0
    since_ckpt = 0.0  # useful work not yet protected by a checkpoint
    for fail_at, predicted, lead, fail_p in failures:
        if fail_at < t:
            continue  # struck while the job was already down: absorbed by that restart
        # A prediction whose lead reaches back past now fires at once.
        proactive_at = max(t, fail_at - lead) if alarms and predicted else math.inf
        predicted_fired = weighed = False
        # Train, checkpointing every `interval` of useful work, until the failure.
        while t < fail_at:
            next_ckpt = t + ((risk_interval if predicted_fired else interval) - since_ckpt)
            event = min(next_ckpt, fail_at, proactive_at, next_fa)
            work = event - t
            b.useful_s += work
            since_ckpt += work
            t = event
            if event == fail_at:
                break
            # A checkpoint: periodic, proactive (prediction) or a false alarm's; (d) weighs
            # an alarm first and does nothing on one its cost model declines.
            if event in (proactive_at, next_fa):
                prediction = event == proactive_at
                if prediction:
                    proactive_at, alarm_p = math.inf, fail_p
                else:
                    next_fa = t + fa_rng.expovariate(fa_rate)
                    alarm_p = draw_p(p_rng, p.false_alarm_p)
                b.alarms += not (prediction and weighed)
                weighed = weighed or prediction
                if gate is not None and not gate.weigh(alarm_p, since_ckpt, t):
                    proactive_at = t + REWEIGH_S if prediction else proactive_at  # alarmed
                    continue
                b.ordered += 1
                predicted_fired = predicted_fired or prediction
            if t + p.checkpoint_s > fail_at:  # the failure lands during the checkpoint
                b.checkpoint_s += fail_at - t
                t = fail_at
                break
            b.checkpoint_s += p.checkpoint_s
            t += p.checkpoint_s
            since_ckpt = 0.0
            proactive_at = max(proactive_at, t)
            if next_fa < t:
                next_fa = t + fa_rng.expovariate(fa_rate)
        # The failure: the unprotected work is redone, the hang waits to be noticed, restart.
        b.failures += 1
        b.useful_s -= since_ckpt
        b.rework_s += since_ckpt
        since_ckpt = 0.0
        b.detection_s += detect
        b.restart_s += p.restart_s
        t += detect + p.restart_s
        if next_fa < t:
            next_fa = t + fa_rng.expovariate(fa_rate)
    # Train to the horizon after the last failure (periodic checkpoints only).
    while t < horizon:
        work = min(interval - since_ckpt, horizon - t)
        b.useful_s += work
        t += work
        since_ckpt = 0.0
        stall = min(p.checkpoint_s, horizon - t)
        b.checkpoint_s += stall
        t += stall
    # Downtime running past the horizon does not count.
    over = t - horizon
    for part in ("restart_s", "detection_s", "checkpoint_s"):
        cut = min(over, getattr(b, part))
        setattr(b, part, getattr(b, part) - cut)
        over -= cut
    return b


def compare(p: RunParams, runs: int = 20) -> dict[str, Breakdown]:
    """Average ``runs`` seeds of each mode (same seeds across modes)."""
    out = {}
    for mode in MODES:
        total = Breakdown()
        for seed in range(runs):
            r = simulate(p, mode, seed)
            for f in dataclasses.fields(Breakdown):
                setattr(total, f.name, getattr(total, f.name) + getattr(r, f.name))
        out[mode] = total
    return out


@dataclasses.dataclass(frozen=True)
class ElasticParams:
    """What a membership change costs. Times in seconds."""

    replace_s: float = 1800.0
    """From a node failure until a replacement node can join: spare pool, scheduling, the
    prolog's health check (an assumption; set it to your cluster's)."""
    rendezvous_s: float = 120.0
    """Stall of an elastic membership change: torchrun's re-rendezvous, worker restart and
    checkpoint load, without rescheduling the job."""


@dataclasses.dataclass
class ElasticRun:
    """Node-seconds of one run: held by the job, spent on progress that stayed, redone."""

    held_node_s: float = 0.0
    useful_node_s: float = 0.0
    rework_node_s: float = 0.0
    failures: int = 0

    @property
    def utilisation(self) -> float:
        """Progress per node-second held (a node that failed is not held; a job waiting
        for its replacement holds its healthy nodes)."""
        return self.useful_node_s / self.held_node_s if self.held_node_s else 0.0


def simulate_elastic(p: RunParams, e: ElasticParams, elastic: bool,
                     seed: int = 0) -> ElasticRun:
    """One run of ``p`` where each failure takes one node out until its replacement joins
    ``e.replace_s`` later. ``elastic=False``: the job stops, waits for the replacement and
    restarts at full size (``p.restart_s``). ``elastic=True``: it shrinks by the node and
    goes on after ``e.rendezvous_s`` at the smaller size, and grows back when the
    replacement joins (a planned change: checkpoint first, then a rendezvous, no rework).
    Either way the work since the last checkpoint is redone and the failure is noticed after
    ``p.detect_s``. Failures strike live nodes while they train, at each node's rate."""
    rng = random.Random(seed)
    n = max(1, math.ceil(p.gpus / GPUS_PER_NODE))
    node_rate = 1.0 / (p.mtbf_s * n)
    horizon = p.days * 86400.0
    interval = p.interval_s or daly_interval(p.checkpoint_s, p.mtbf_s)
    r = ElasticRun()
    t, live, computed, unsaved = 0.0, n, 0.0, 0.0  # computed: s since the last checkpoint
    joins: list[float] = []

    def stall(seconds: float, nodes: int) -> None:
        nonlocal t
        seconds = min(seconds, horizon - t)
        r.held_node_s += seconds * nodes
        t += seconds

    while t < horizon:
        fail_at = t + rng.expovariate(node_rate * live)
        join_at = min(joins, default=math.inf)
        event = min(fail_at, join_at, t + interval - computed, horizon)
        r.held_node_s += (event - t) * live
        r.useful_node_s += (event - t) * live
        unsaved += (event - t) * live
        computed += event - t
        t = event
        if t >= horizon:
            break
        if event == fail_at:
            r.failures += 1
            r.useful_node_s -= unsaved
            r.rework_node_s += unsaved
            live -= 1
            if elastic and live > 0:
                joins.append(t + e.replace_s)
                stall(p.detect_s + e.rendezvous_s, live)
            else:  # wait for the replacement, then restart at full size
                stall(p.detect_s + e.replace_s + p.restart_s, live)
                live = n
        elif event == join_at:
            joins.remove(join_at)
            stall(p.checkpoint_s, live)
            live += 1
            stall(e.rendezvous_s, live)
        else:
            stall(p.checkpoint_s, live)
        computed, unsaved = 0.0, 0.0  # a checkpoint was taken, or the work was lost
    return r


def compare_elastic(p: RunParams, e: ElasticParams, runs: int = 10) -> dict[str, ElasticRun]:
    """Sum ``runs`` seeds of waiting for a replacement and of elastic continuation."""
    out = {}
    for mode, elastic in (("wait_replace", False), ("elastic", True)):
        total = ElasticRun()
        for seed in range(runs):
            r = simulate_elastic(p, e, elastic, seed)
            for f in dataclasses.fields(ElasticRun):
                setattr(total, f.name, getattr(total, f.name) + getattr(r, f.name))
        out[mode] = total
    return out


def _elastic_table(rows: list[tuple[RunParams, ElasticParams, dict[str, ElasticRun]]]) -> str:
    head = (f"{'GPUs':>7} {'node failures/h':>15} {'mode':<13} {'GPU utilisation':>15} "
            f"{'redone':>7} {'replace s':>9} {'rendezvous s':>12}")
    lines = [head, "-" * len(head)]
    for p, e, res in rows:
        per_h = 3600.0 / p.mtbf_s
        for mode, r in res.items():
            lines.append(
                f"{p.gpus:>7} {per_h:>15.2f} {mode:<13} {r.utilisation:>15.2%} "
                f"{r.rework_node_s / r.held_node_s if r.held_node_s else 0.0:>7.2%} "
                f"{e.replace_s:>9.0f} {e.rendezvous_s:>12.0f}")
    return "\n".join(lines)


def _table(rows: list[tuple[RunParams, dict[str, Breakdown]]]) -> str:
    head = (
        f"{'GPUs':>7} {'MTBF h':>7} {'mode':<15} {'goodput':>8} {'ckpt':>6} {'redo':>6} "
        f"{'detect':>6} {'restart':>7} {'GPU-h saved/day':>16} {'alarms/day':>10} "
        f"{'saves/day':>9}"
    )
    lines = [head, "-" * len(head)]
    for params, res in rows:
        base = res["baseline"]
        gpus, mtbf_h = params.gpus, params.mtbf_s / 3600.0
        for mode, b in res.items():
            saved = (b.goodput - base.goodput) * gpus * 24.0
            days = b.wall_s / 86400.0 if b.wall_s else 1.0
            lines.append(
                f"{gpus:>7} {mtbf_h:>7.2f} {mode:<15} {b.goodput:>8.4f} "
                f"{b.waste('checkpoint_s'):>6.2%} {b.waste('rework_s'):>6.2%} "
                f"{b.waste('detection_s'):>6.2%} {b.waste('restart_s'):>7.2%} {saved:>16.1f} "
                f"{b.alarms / days:>10.1f} {b.ordered / days:>9.1f}"
            )
    return "\n".join(lines)


def _plot(rows: list[tuple[RunParams, dict[str, Breakdown]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    sizes = [p.gpus for p, _ in rows]
    labels = {
        "baseline": "(a) periodic, NCCL-timeout detection",
        "fast_detection": "(b) + fast hang detection",
        "proactive": "(c) + a checkpoint on every alarm",
        "gated": "(d) + a checkpoint where the cost model says",
    }
    for mode, label in labels.items():
        ax.plot(sizes, [r[mode].goodput * 100 for _, r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("effective training time (%)")
    ax.set_title("Goodput by job size (simulated, Daly-optimal interval)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "simulate",
        help="simulate long training runs: what fast detection and prediction save",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    d = RunParams()
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="job sizes to simulate (default: 1024 4096 16384)")
    p.add_argument("--days", type=float, default=d.days, help="wall time of each run")
    p.add_argument("--runs", type=int, default=10, help="seeds averaged per configuration")
    p.add_argument("--checkpoint-s", type=float, default=d.checkpoint_s, help="checkpoint cost C")
    p.add_argument("--restart-s", type=float, default=d.restart_s, help="restart cost R")
    p.add_argument("--failures-per-1k-node-days", type=float,
                   default=d.failures_per_1k_node_days, help="node failure rate (Meta: 2.3-6.5)")
    p.add_argument("--detect-s", type=float, default=d.detect_s,
                   help="forewarn's hang detection latency")
    p.add_argument("--recall", type=float, default=d.recall, help="predictor recall")
    p.add_argument("--lead-median-s", type=float, default=d.lead_median_s,
                   help="median prediction lead time")
    p.add_argument("--predictable-share", type=float, default=d.predictable_share,
                   help="share of failures with a visible precursor (assumption)")
    p.add_argument("--false-alarms", type=float, default=d.false_alarms_per_1k_gpu_days,
                   help="false alarms per 1,000 GPU-days (each costs one checkpoint)")
    p.add_argument("--true-alarm-p", nargs="+", type=parse_band, metavar="P:SHARE",
                   help="(d): P carried by alarms a failure follows, in bands (default: the "
                        "shipped model's, " + _bands(d.true_alarm_p) + ")")
    p.add_argument("--false-alarm-p", nargs="+", type=parse_band, metavar="P:SHARE",
                   help="(d): P carried by false alarms (default: " + _bands(d.false_alarm_p)
                        + ")")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    e = ElasticParams()
    p.add_argument("--elastic", action="store_true",
                   help="also compare waiting for a replacement node with shrinking and going "
                        "on (torchrun elastic), by GPU utilisation")
    p.add_argument("--replace-s", type=float, default=e.replace_s,
                   help="time until a replacement node joins (assumption)")
    p.add_argument("--rendezvous-s", type=float, default=e.rendezvous_s,
                   help="stall of an elastic membership change: re-rendezvous and reload")
    p.set_defaults(func=_run)


def _bands(bands: tuple[tuple[float, float], ...]) -> str:
    return " ".join(f"{p:g}:{w:g}" for p, w in bands)


def _run(args: argparse.Namespace) -> int:
    d = RunParams()
    rows = []
    for gpus in args.gpus:
        params = RunParams(
            gpus=gpus, days=args.days, checkpoint_s=args.checkpoint_s, restart_s=args.restart_s,
            failures_per_1k_node_days=args.failures_per_1k_node_days, detect_s=args.detect_s,
            recall=args.recall, lead_median_s=args.lead_median_s,
            predictable_share=args.predictable_share,
            false_alarms_per_1k_gpu_days=args.false_alarms,
            true_alarm_p=tuple(args.true_alarm_p or d.true_alarm_p),
            false_alarm_p=tuple(args.false_alarm_p or d.false_alarm_p),
        )
        rows.append((params, compare(params, runs=args.runs)))
    print(_table(rows))
    if args.elastic:
        print()
        print(_elastic_table([
            (params, ep, compare_elastic(params, ep, runs=args.runs)) for params, _ in rows
            for ep in [ElasticParams(replace_s=args.replace_s, rendezvous_s=args.rendezvous_s)]]))
    if args.plot:
        _plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0
