"""Work in parts on the policy thread (collector/decide/scoring_pass.py, a real
PolicyThread): urgent items run between the parts, other decision work after the last; one
pass at a time; a part that raises ends its pass, is counted, and the next pass runs."""

from __future__ import annotations

import threading

from forewarn.collector.decide.policy_thread import PolicyThread
from forewarn.collector.decide.scoring_pass import PartRunner, Parts


def test_urgent_items_run_between_the_parts_and_decision_items_after_the_last() -> None:
    pool = PolicyThread()
    ran: list[str] = []
    done = threading.Event()
    runner = PartRunner(pool.submit_next, lambda: None)

    def scoring() -> Parts:
        ran.append("part 1")
        pool.submit(ran.append, "telemetry")  # queued while the pass is under way
        pool.submit_urgent(ran.append, "urgent")
        runner.run(second())  # found due again meanwhile: dropped
        yield
        ran.append("part 2")
        yield
        ran.append("part 3")
        done.set()

    def second() -> Parts:
        ran.append("second pass")
        yield

    try:
        pool.submit(runner.run, scoring()).result(30)
        assert done.wait(30)
        pool.submit(lambda: None).result(30)  # everything queued before it has run
    finally:
        pool.shutdown()
    assert ran == ["part 1", "urgent", "part 2", "part 3", "telemetry"]


def test_a_failing_part_is_counted_and_the_next_pass_runs() -> None:
    pool = PolicyThread()
    failed: list[int] = []
    ran: list[str] = []
    runner = PartRunner(pool.submit_next, lambda: failed.append(1))

    def broken() -> Parts:
        yield
        raise ValueError("a model that cannot score")

    def working() -> Parts:
        yield
        ran.append("scored")

    try:
        pool.submit(runner.run, broken()).result(30)
        pool.submit(lambda: None).result(30)
        pool.submit(runner.run, working()).result(30)
        pool.submit(lambda: None).result(30)
    finally:
        pool.shutdown()
    assert failed == [1]
    assert ran == ["scored"]
