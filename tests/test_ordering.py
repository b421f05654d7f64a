"""The one rule for the checkpoint step (forewarn.ordering), its properties under hypothesis,
and that agent and collector both follow it."""

import math

from hypothesis import given
from hypothesis import strategies as st

from forewarn.ordering import RankProgress, estimated_step, order_step

ranks_st = st.lists(
    st.builds(
        RankProgress,
        last_step=st.one_of(st.none(), st.integers(0, 10**9)),
        last_step_time=st.one_of(st.none(), st.floats(0, 1e6)),
        step_s=st.one_of(st.none(), st.floats(1e-4, 1e3)),
    ),
    max_size=16,
)
pace_st = st.one_of(st.none(), st.floats(1e-4, 1e3))


@given(ranks=ranks_st, now=st.floats(0, 2e6), p50=pace_st, lead=st.floats(0, 60),
       floor=st.one_of(st.none(), st.integers(0, 10**9)))
def test_s_is_ahead_of_every_rank_and_of_the_floor(ranks, now, p50, lead, floor) -> None:
    est = estimated_step(ranks, now)
    step, margin = order_step(est, p50, lead_s=lead, floor=floor)
    for r in ranks:
        if r.last_step is not None:
            assert step > r.last_step
    assert step > (floor or 0) and margin >= 1
    if p50:
        assert margin >= math.ceil(lead / p50)  # the steps the fastest rank makes meanwhile


@given(ranks=ranks_st, now=st.floats(0, 1e6), later=st.floats(0, 1e6), p50=pace_st,
       lead=st.floats(0, 60), more=st.floats(0, 60))
def test_s_never_moves_back_as_time_or_lead_grows(ranks, now, later, p50, lead, more) -> None:
    s0, _ = order_step(estimated_step(ranks, now), p50, lead_s=lead)
    s1, _ = order_step(estimated_step(ranks, now + later), p50, lead_s=lead + more)
    assert s1 >= s0


def test_margin_is_clamped() -> None:
    assert order_step(100, 0.001, lead_s=10.0, max_margin=50) == (150, 50)
    assert order_step(100, 100.0, lead_s=0.1, min_margin=5) == (105, 5)
    assert order_step(None, None, lead_s=1.0, unknown_margin=10) == (11, 11)


def test_agent_and_collector_choose_the_same_step_for_the_same_job() -> None:
    """One rule: for a one-node job whose ranks keep one pace, the collector's S equals the
    agent's, given the same reports and the same lead."""
    import dataclasses

    from forewarn.agent.orders import choose_step as agent_choose
    from forewarn.agent.rank_state import RankView
    from forewarn.collector.decide.orders import OrderSettings
    from forewarn.collector.decide.orders import choose_step as collector_choose
    from forewarn.collector.jobs.jobview import JobInfo
    from forewarn.wire import RankSummary

    now = 1_700_000_000.0
    reports = [(40, now - 1.0), (42, now - 0.55)]
    blank = {f.name: None for f in dataclasses.fields(RankView)}
    views = [RankView(**{**blank, "job": "j", "rank": rank, "last_step": step,
                         "last_progress": t, "step_seconds": (0.1,) * 20})
             for rank, (step, t) in enumerate(reports)]
    agent_s = agent_choose(views, now, delivery_latency_s=0.5, safety_s=2.0)
    job = JobInfo(job="j", first_seen=now - 60, ranks=tuple(
        RankSummary(job="j", rank=rank, node="n", pid=1, last_step=step, last_step_time=t,
                    step_seconds_p50=0.1) for rank, (step, t) in enumerate(reports)))
    settings = OrderSettings(delivery_latency_s=0.5, safety_s=2.0, min_margin_steps=1)
    collector_s, _ = collector_choose(job, now, settings)
    assert agent_s == collector_s == 50 + 26
