"""Checkpoint interval advice reaches the job's agents as a step count every rank shares
(advise_hooks, on by default; hooks opt in with follow_advice, tested in
test_hook_monitor.py)."""

from __future__ import annotations

import time
from pathlib import Path

from forewarn.collector.config import CollectorConfig
from forewarn.collector.jobs.goodput import advise_interval

from support.collector import ranks_on, start_service, stop_service
from support.polling import poll


def test_advice_is_sent_to_every_node_of_the_job(tmp_path: Path) -> None:
    assert CollectorConfig().advise_hooks  # on by default: hooks opt in with follow_advice
    svc = start_service(tmp_path, advise_hooks=True, predictor_enabled=False,
                        predict_interval_s=0.2)
    try:
        now = time.time()
        svc.push("node1", ranks=ranks_on("node1", 0, now))
        svc.push("node2", ranks=ranks_on("node2", 2, now))

        def advice(node: str) -> list[dict[str, object]]:
            return [c for c in svc.commands(node, wait=0.5) if c["kind"] == "advice"]

        got = {n: poll(lambda n=n: advice(n), timeout=20) for n in ("node1", "node2")}
        a1, a2 = got["node1"][0]["advice"], got["node2"][0]["advice"]
        assert a1 == a2 and a1["job"] == "train-1"
        # Daly's interval from the ranks' checkpoint time (30 s), 4 GPUs, in 0.2 s steps.
        interval = advise_interval(30.0, 4)
        assert a1["interval_s"] == interval
        assert a1["every_steps"] == round(interval / 0.2)
        assert a1["from_step"] > 500  # ahead of the job's furthest rank
    finally:
        stop_service(svc)


def test_no_advice_when_disabled(tmp_path: Path) -> None:
    svc = start_service(tmp_path, advise_hooks=False, predictor_enabled=False,
                        predict_interval_s=0.2)
    try:
        svc.push("node1", ranks=ranks_on("node1", 0, time.time()))
        time.sleep(1.5)
        assert svc.commands("node1") == []
    finally:
        stop_service(svc)
