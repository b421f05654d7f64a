"""Which local ranks an order or a save hold is for, and what the collector is told.

An order is for every rank of its job this node knows whose process still runs, not only
the ranks it counts as live: a rank is marked gone after a few missed beats, and that
happens without the rank stopping. The agent itself may have been stopped (SIGSTOP, a
swapped-out host): the ranks' beats wait unread in its socket, the first poll after it
resumes marks them gone, and they are back alive a few milliseconds later. An order that
came in between and went only to live ranks was lost: acked ``no live rank``, never
delivered, never ``missed``, so the collector (which reissues only on ``missed``) counted it
delivered and the job did not checkpoint. So the order goes to every such rank at once (a
datagram to a stopped or busy process waits in its socket), one that cannot take it yet is
retried every poll, and each rank saves at S once (the hook takes an order id once and one
save serves every order for a step). The order ends when a rank's process is replaced by a
new one (the job restarted: :mod:`forewarn.agent.orders`). A rank that finished, or whose
process is gone, will never save: it is not waited for.

S itself is chosen from the live ranks (a gone rank's last step is old), from the known ones
when none is live.
"""

from __future__ import annotations

from collections.abc import Collection

from forewarn.agent.rank_state import RankView
from forewarn.agent.ranks import RankTable

__all__ = ["ack_detail", "job_ranks"]


def job_ranks(table: RankTable, job: str, now: float) -> tuple[list[RankView], list[RankView]]:
    """``(known, live)``: the ranks of ``job`` an order is for (module docstring), and
    those of them the table counts as live now."""
    known = [v for v in table.job_views(job)
             if not v.finished and table.proc.alive(v.os_pid, v.start_time)]
    return known, [v for v in known if table.alive(v, now)]


def ack_detail(job: str, step: int | None, not_live: Collection[int],
               waiting: Collection[int]) -> str:
    """The acknowledgement's detail for an order of ``job`` (``step`` None: none sent):
    the ranks that were ``not_live``, and those the order has not reached yet
    (``waiting``: its datagram failed, retried on every poll)."""
    if step is None:
        return f"no live rank of job {job!r} on this node: none known here"
    out = f"ordered step {step}"
    if not_live:
        ranks = ", ".join(str(r) for r in sorted(not_live))
        out += (f"; rank(s) {ranks} not live now: the order waits for them "
                "(until they beat again, or their process is replaced)")
    if waiting:
        ranks = ", ".join(str(r) for r in sorted(waiting))
        out += (f"; rank(s) {ranks} not reached yet: retried on every poll (until they "
                "take it, their process is replaced, or the order is older than its "
                "time to live)")
    return out
