"""Records between a training rank's hook and its node agent (orders and advice also
travel collector -> agent inside a :class:`~forewarn.wire.Command`)."""

from __future__ import annotations

from typing import Annotated, Final

from msgspec import Meta, Struct, field

from .base import (
    INT64_MAX,
    WIRE_VERSION,
    Name,
    NonNegInt,
    PhaseName,
    Rank,
    Seconds,
    Text,
    UnixTime,
    Version,
)


class _FromRank(Struct, frozen=True, kw_only=True):
    """Who sent a hook -> agent datagram: the first fields of each, in this order (the
    hook's hand-rolled step encoding, ``hook/_pack.py``, relies on it)."""

    v: Version = WIRE_VERSION
    job: Name
    rank: Rank
    local_rank: Rank = 0
    world_size: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    pid: Annotated[int, Meta(ge=1, le=INT64_MAX)]
    host: Name


class StepRecord(_FromRank, frozen=True, kw_only=True, tag="step"):
    """hook -> agent: one training step of one rank. ``loss`` may be NaN or Inf."""

    step: NonNegInt
    time: UnixTime
    step_seconds: Seconds | None = None
    loss: float | None = None
    grad_norm: float | None = None
    extras: dict[Annotated[str, Meta(max_length=64)], float] = field(default_factory=dict)


class Beat(_FromRank, frozen=True, kw_only=True, tag="beat"):
    """hook -> agent: liveness from the rank's background thread, sent even when stuck."""

    time: UnixTime
    last_step: NonNegInt | None = None
    dropped: NonNegInt = 0
    reply_to: Annotated[str, Meta(max_length=256)] = ""
    """Path of the rank's own datagram socket, where the agent sends orders."""
    phase: PhaseName = ""
    """The phase the rank is in (``eval``, ``data``, ``compile``, ``checkpoint``, ...: a
    long step is expected there); empty while training steps."""
    phase_started: UnixTime | None = None
    """When the current phase began (the rank's clock)."""
    phase_longest: Annotated[dict[PhaseName, Seconds], Meta(max_length=16)] = field(
        default_factory=dict)
    """Longest finished stay in each phase so far: the agent learns its hang bound per
    phase from it (at most 16 phases)."""
    preempted: bool = False
    """The rank got a preemption notice (signal or maintenance file): the agent orders the
    whole job to save one step ahead of its fastest rank."""
    finished: bool = False
    """The rank ended cleanly (``Monitor.close()``, atexit): never hung or gone."""


class CheckpointReport(Struct, frozen=True, kw_only=True, tag="checkpoint"):
    """hook -> agent -> collector: a rank's checkpoint progress for one order.

    ``phase``: ``started``, ``done``, ``failed``, or ``missed`` (the ordered step had
    already passed when the order arrived; ``step`` then holds the rank's current step).
    """

    v: Version = WIRE_VERSION
    job: Name
    rank: Rank
    host: Annotated[str, Meta(max_length=256)] = ""
    request_id: Annotated[str, Meta(max_length=128)] = ""
    step: NonNegInt
    phase: Annotated[str, Meta(pattern="^(started|done|failed|missed)$")]
    seconds: Seconds | None = None
    bytes: NonNegInt | None = None
    time: UnixTime
    path: Annotated[str, Meta(max_length=4096)] = ""


HookMessage = StepRecord | Beat | CheckpointReport
"""Everything a rank sends to its agent."""


class CheckpointOrder(Struct, frozen=True, kw_only=True, tag="order"):
    """agent -> hook, collector -> agent: every rank of ``job`` saves at ``step``."""

    v: Version = WIRE_VERSION
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    job: Name
    step: NonNegInt
    reason: Text = ""
    issued: UnixTime


PREEMPTED: Final = "preempted"
"""A :class:`CheckpointOrder` whose reason is this or starts with ``"preempted:"`` orders
a job being preempted to save: every rank that gets it exits after that save."""


class IntervalAdvice(Struct, frozen=True, kw_only=True, tag="advice"):
    """collector -> agent -> hook: the advised periodic checkpoint interval of ``job``.

    Daly's interval (``interval_s``) converted by the collector into steps, so that every
    rank of the job counts the same steps: a rank that follows the advice saves at
    ``from_step + k * every_steps`` (k = 0, 1, ...). ``from_step`` lies ahead of the job's
    fastest rank, chosen as a checkpoint order's step is, so all ranks switch together.
    """

    v: Version = WIRE_VERSION
    job: Name
    every_steps: Annotated[int, Meta(ge=1, le=INT64_MAX)]
    from_step: NonNegInt
    interval_s: Annotated[float, Meta(gt=0.0)]
    reason: Text = ""
    issued: UnixTime


class SaveHold(Struct, frozen=True, kw_only=True, tag="hold"):
    """collector -> agent -> hook: the training state of ``job`` is suspect since
    ``onset_step`` (a NaN/Inf loss or a grad-norm spike): checkpoints of that step or later
    are marked suspect, and from ``step`` on the ranks save nothing unless told (ordered
    and periodic saves are refused). ``step`` lies ahead of the job's fastest rank, chosen
    as a checkpoint order's step is, so every rank stops saving at the same step and no
    rank waits in a collective save for a peer that refused.

    A rank that has already passed ``step`` unheld when the hold arrives holds from the step
    after and reports ``missed`` (a :class:`CheckpointReport` with the hold's ``request_id``
    and the last step it passed unheld); whoever issued the hold issues it again from the
    step after that one (:func:`forewarn.ordering.replacement_hold`), with ``replaces`` naming
    the hold it replaces: every rank then holds from the new ``step`` instead."""

    v: Version = WIRE_VERSION
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    job: Name
    onset_step: NonNegInt
    step: NonNegInt
    reason: Text = ""
    issued: UnixTime
    replaces: Annotated[str, Meta(max_length=128)] = ""
    """Request id of the hold this one re-issues (empty for a first hold)."""


AgentMessage = CheckpointOrder | IntervalAdvice | SaveHold
"""Everything an agent sends to a rank."""
