"""The step a rank's own preemption save is made at, agreed with the job's other ranks.

A scheduler signals every rank of a job at once (``scancel``, Slurm preemption), but the
ranks are not at the same point of their loops when it arrives: one may have passed its
``should_checkpoint(s)`` a few milliseconds before the signal, its peer not. Each saving
at its own next step (s+1 and s) puts the ranks in different collectives (the DCP save's
barrier against DDP's all-reduce of the next step) and the job hangs until the
scheduler kills it, unsaved.

So with a process group of several ranks, the first rank to act on its notice proposes
its *next* step in the process group's key-value store (``compare_set``: the first
proposal wins) and every noticed rank saves at the step the store holds. A rank cannot be
more than one step past its peer while each step has a collective (DDP's all-reduce), so
the proposer's next step is one no rank has passed yet. A rank that got no notice of its
own still needs the agent's order or ``agree_every`` (nothing here reaches it).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["preempt_step"]

_log = logging.getLogger("forewarn.hook")


def preempt_step(job: str, step: int) -> int:
    """The step this rank's preemption save is made at: ``step`` (now) with no process
    group of several ranks, else the step agreed in the group's store (``step + 1`` when
    this rank proposes it). Never raises: a store that cannot answer means ``step``."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            return step
        if dist.get_world_size() < 2:
            return step
        store = dist.distributed_c10d._get_default_store()
        # one key per job and torchrun restart round (an earlier round's key may remain)
        key = f"forewarn/preempt-step/{job}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        # compare_set with an empty expected value sets the key only if it is absent, and
        # returns what the store holds then: the first proposal, whoever made it
        agreed = int(store.compare_set(key, "", str(step + 1)))
    except Exception as exc:  # the guest never raises into the training loop
        _log.warning("forewarn: no preemption step agreed through the process group's "
                     "store (%r); saving at step %d", exc, step)
        return step
    if agreed < step:
        # a peer proposed a step this rank has passed (the ranks were more than one step
        # apart: no collective per step); saving now is all that is left
        _log.warning("forewarn: the job's preemption step %d has passed; saving at step %d",
                     agreed, step)
        return step
    return agreed
