"""The severity rules: which action kinds a finding calls for, from its health and its
suggested action (:data:`SEVERITY_RULES`, applied by :func:`actions_for`), and what the
policy can decide about each (:class:`Outcome`).

To add an action kind: a member of :class:`ActionKind`, its rule here, its gate in
:class:`~.policy.Policy` and its actuator in :class:`~.actions.ActionPipeline`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["HOLD_CHECKS", "SEVERITY_RULES", "ActionKind", "Outcome", "actions_for"]


class ActionKind(enum.StrEnum):
    """What the collector can do about a finding."""

    CHECKPOINT = "checkpoint"
    WEBHOOK = "webhook"
    DRAIN = "drain"
    HOLD = "hold"
    """Stop the job's saves: its training state is suspect (bad numerics)."""


class Outcome(enum.StrEnum):
    """What the policy decided for one action on one target."""

    ACT = "act"
    SHADOW = "shadow"
    """Would have acted; shadow mode recorded it instead."""
    SUPPRESSED = "suppressed"
    """Not needed or not allowed now: no job, below cost, cooldown, rate limit."""
    REFUSED = "refused"
    """The circuit breaker refused a mass action."""


_ACTIVE = frozenset(
    {
        SuggestedAction.CHECKPOINT,
        SuggestedAction.RESTART_JOB,
        SuggestedAction.RESET_GPU,
        SuggestedAction.REBOOT,
        SuggestedAction.DRAIN,
        SuggestedAction.INSPECT_HARDWARE,
    }
)
_DRAIN = frozenset({SuggestedAction.DRAIN, SuggestedAction.INSPECT_HARDWARE})

HOLD_CHECKS: frozenset[str] = frozenset({"nan_loss"})
"""Checks whose unhealthy findings hold the job's saves by default (``policy_hold_checks``;
add ``grad_spike`` to roll back past spikes PaLM-style: the hook then saves nothing after
a spike until the user calls ``Monitor.release_hold()``)."""

SEVERITY_RULES: Mapping[str, str] = {
    "healthy": "nothing (clears dedup for the subject)",
    "unhealthy + check in policy_hold_checks (nan_loss by default)":
        "hold the job's saves (state suspect since the finding's bad_step) + webhook",
    "unknown": "nothing (the check could not tell; its own metrics show it)",
    "degraded + none/watch": "webhook",
    "degraded + any other action": "checkpoint (cost-aware) + webhook",
    "unhealthy + none/watch": "checkpoint (cost-aware) + webhook",
    "unhealthy + restart_job": "webhook (a hung, dead or diverged job cannot save usefully)",
    "unhealthy + checkpoint/reset_gpu/reboot": "checkpoint (cost-aware) + webhook",
    "unhealthy + drain/inspect_hardware": "checkpoint (cost-aware) + webhook + drain",
}
"""The severity rules as :func:`actions_for` applies them (documentation and the API)."""


def actions_for(finding: Finding, hold_checks: frozenset[str] = HOLD_CHECKS
                ) -> tuple[ActionKind, ...]:
    """The action kinds :data:`SEVERITY_RULES` give ``finding``."""
    if finding.health == Health.UNHEALTHY and finding.check in hold_checks:
        # the state is poisoned (or suspect): saving it is useless and would rotate a
        # good checkpoint out; the ranks stop saving and mark what they saved since
        return (ActionKind.HOLD, ActionKind.WEBHOOK)
    if finding.action == SuggestedAction.RESTART_JOB:
        # Hang, dead rank, NaN loss: the job cannot write a checkpoint worth keeping (a
        # hung rank never reaches the step, a dead one blocks its peers, a NaN state is
        # poison that would rotate a good checkpoint out). The agent ends or flags it.
        return (ActionKind.WEBHOOK,)
    if finding.health == Health.UNHEALTHY:
        kinds = [ActionKind.CHECKPOINT, ActionKind.WEBHOOK]
        if finding.action in _DRAIN:
            kinds.append(ActionKind.DRAIN)
        return tuple(kinds)
    if finding.health == Health.DEGRADED:
        if finding.action in _ACTIVE:
            return (ActionKind.CHECKPOINT, ActionKind.WEBHOOK)
        return (ActionKind.WEBHOOK,)
    return ()
