"""False alarms of the live scorer after a backlog (forewarn.models.live).

A simulated fleet (:mod:`forewarn.models.fleetsim`) is fed to a
:class:`~forewarn.models.live.LiveScorer` with the shipped default model as the collector
feeds it: each sample arrives ``--delay-s`` after its time, the scorer scores every
``--interval-s`` of wall clock. At ``--at-h`` hours nothing arrives for ``--backlog-min``
minutes (a bus or collector outage, a paused leader) while the scorer goes on scoring;
then the backlog arrives in order, ``--catch-up-min`` minutes of data at each scoring,
until the scorer reads the live data again. Every scoring's alarm findings are judged
against the fleet's failures: an alarm on a GPU that fails within the model's horizon is
true, any other false. The same fleet is fed once without a backlog as the reference.
With ``--ahead-s`` there is no backlog: the first node's agent stamps its samples and XIDs
that much ahead (they arrive at their true time), the other GPUs' scores are compared with
the reference.

Run: ``python bench/backlog_alarms.py [--nodes 16] [--hours 16] [--at-h 10 13]
[--ahead-s 180]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from forewarn.models.fleetsim import FleetData, load_params, simulate_fleet
from forewarn.models.live import LiveScorer
from forewarn.models.persist import load_default_model
from forewarn.wire import GpuSample, GpuState, NvlinkCounters, XidEvent

_KEYS = ("gpu", "uuid", "time", "temperature_c", "slowdown_margin_c", "power_w",
         "power_limit_w", "throttle_reasons", "ecc_corrected_volatile",
         "ecc_uncorrected_volatile", "remapped_rows_correctable", "remapped_rows_uncorrectable",
         "remap_pending", "remap_failure", "retired_pages_sbe", "retired_pages_dbe",
         "pcie_replay_total", "pcie_link_width", "pcie_link_width_max")


def _events(d: FleetData, end: float, fast: str = "", ahead_s: float = 0.0
            ) -> list[tuple[float, GpuSample | XidEvent]]:
    """The fleet's samples and XIDs before ``end`` as the agents send them, (arrival, event)
    in arrival order; node ``fast`` stamps them ``ahead_s`` late."""
    out: list[tuple[float, GpuSample | XidEvent]] = []
    for r in d.samples[d.samples.time < end].to_dict("records"):
        if r["node"] == fast:
            r["time"] += ahead_s
        kw = {k: (r[k].item() if hasattr(r[k], "item") else r[k]) for k in _KEYS}
        links = tuple(NvlinkCounters(link=k, crc_flit=int(r[f"nvlink{k}_crc_flit"]),
                                     replay=int(r[f"nvlink{k}_replay"])) for k in range(4))
        sample = GpuSample(node=str(r["node"]), source="sim", simulated=True,
                           state=GpuState(str(r["state"])), nvlink=links, **kw)
        out.append((float(r["time"]) - (ahead_s if r["node"] == fast else 0.0), sample))
    for x in d.xids[d.xids.time < end].itertuples():
        shift = ahead_s if x.node == fast else 0.0
        out.append((float(x.time), XidEvent(node=str(x.node), gpu=int(x.gpu), code=int(x.xid),
                                            time=float(x.time) + shift, source="sim",
                                            simulated=True)))
    out.sort(key=lambda e: e[0])
    return out


def _arrivals(events: Sequence[tuple[float, Any]], start: float, end: float, interval_s: float,
              delay_s: float, outage: tuple[float, float] | None, catch_up_s: float
              ) -> Iterator[tuple[float, Sequence[Any]]]:
    """(scoring time, what arrived since the last scoring), the outage's data held back and
    then read ``catch_up_s`` of data time at each scoring until caught up."""
    i, t = 0, start
    while t < end:
        due = t - delay_s
        if outage is not None and outage[0] <= due < outage[1]:
            upto = outage[0]  # nothing arrives
        elif outage is not None and i < len(events) and events[i][0] < due - interval_s \
                and events[i][0] >= outage[0]:
            upto = min(due, events[i][0] + catch_up_s)  # reading the backlog
        else:
            upto = due
        j = i
        while j < len(events) and events[j][0] <= upto:
            j += 1
        yield t, [e for _, e in events[i:j]]
        i, t = j, t + interval_s


def run(d: FleetData, events: Sequence[tuple[float, Any]], start: float, end: float,
        args: argparse.Namespace, outage: tuple[float, float] | None) -> dict[str, Any]:
    """Feed the fleet, score, and count the alarms after ``start + args.judge_from_h``."""
    model = load_default_model()
    scorer = LiveScorer(model)
    fails = {(str(r.node), int(r.gpu)): float(r.time) for r in d.labels.itertuples()}
    judged_from = start + args.judge_from_h * 3600
    false_gpus: set[tuple[str, int]] = set()
    true = false = 0
    probs: dict[int, dict[tuple[str, int], float]] = {}
    fast_scored = 0
    for t, arrived in _arrivals(events, start, end, args.interval_s, args.delay_s, outage,
                                args.catch_up_min * 60):
        for e in arrived:
            if isinstance(e, GpuSample):
                scorer.observe(e)
            else:
                scorer.observe_xid(e)
        findings = scorer.score(t)
        c = scorer.computed
        if c is not None:
            keys = [(scorer._nodes[i], scorer._gpus[i]) for i in c.slots.tolist()]
            probs.setdefault(c.minute, {}).update(zip(keys, c.probs.tolist(), strict=True))
            fast_scored += any(k[0] == args.fast for k in keys)
        for f in findings:
            if t < judged_from:
                continue
            key = (f.subject.node, int(f.subject.gpu or 0))
            failed = fails.get(key)
            if failed is not None and t <= failed <= t + model.horizon_s:
                true += 1
            else:
                false += 1
                false_gpus.add(key)
    return {"alarm_scorings_true": true, "alarm_scorings_false": false,
            "gpus_falsely_alarmed": len(false_gpus), "late_samples": scorer.late,
            "scorings_with_fast_node": fast_scored, "probs": probs}


def _differ(ref: dict[int, dict[tuple[str, int], float]],
            got: dict[int, dict[tuple[str, int], float]], after: float, skip: str = ""
            ) -> dict[str, float]:
    """How the scores of the minutes from ``after`` differ from the reference run's (node
    ``skip`` left out): the GPU-minutes scored in both, those more than 0.01 apart, the
    largest difference."""
    diffs = [abs(p - ref[m][i]) for m, row in got.items() if m * 60 >= after and m in ref
             for i, p in row.items() if i in ref[m] and i[0] != skip]
    return {"gpu_minutes_compared": len(diffs),
            "gpu_minutes_off_by_0.01": sum(d > 0.01 for d in diffs),
            "max_score_difference": round(max(diffs, default=0.0), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--hours", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--at-h", type=float, nargs="+", default=[10.0, 13.0],
                    help="when the backlog starts (hours into the run), one run each")
    ap.add_argument("--backlog-min", type=float, default=10.0)
    ap.add_argument("--catch-up-min", type=float, default=2.0,
                    help="minutes of backlog read between two scorings")
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--delay-s", type=float, default=2.0)
    ap.add_argument("--ahead-s", type=float, default=0.0,
                    help="instead of a backlog: the first node's clock this far ahead")
    ap.add_argument("--judge-from-h", type=float, default=8.0,
                    help="alarms before this (baselines still learned) are not counted")
    args = ap.parse_args()
    args.fast = ""
    p = load_params().replace(nodes=args.nodes, days=args.hours / 24.0, seed=args.seed)
    d = simulate_fleet(p)
    start = float(d.samples.time.min())
    end = start + args.hours * 3600
    events = _events(d, end)
    out: dict[str, Any] = {"gpus": p.nodes * p.gpus_per_node, "hours": args.hours,
                           "failures": len(d.labels), "backlog_min": args.backlog_min}
    ref = run(d, events, start, end, args, None)
    ref_probs = ref.pop("probs")
    out["no_backlog"] = ref
    if args.ahead_s > 0:
        args.fast = str(d.samples.node.iloc[0])
        got = run(d, _events(d, end, args.fast, args.ahead_s), start, end, args, None)
        got |= _differ(ref_probs, got.pop("probs"), start + args.judge_from_h * 3600,
                       args.fast)
        out[f"node_ahead_{args.ahead_s:g}s"] = got
        print(json.dumps(out, indent=1))
        return
    for at in args.at_h:
        b = start + at * 3600 + 30.0
        got = run(d, events, start, end, args, (b, b + args.backlog_min * 60))
        got |= _differ(ref_probs, got.pop("probs"), b)
        out[f"backlog_at_{at:g}h"] = got
    print(json.dumps(out, indent=1, default=lambda x: x.item() if isinstance(
        x, np.generic) else str(x)))


if __name__ == "__main__":
    main()
