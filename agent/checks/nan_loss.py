"""NaN or Inf loss (or grad norm).

A non-finite loss means the model's state is (or is about to be) poisoned: unhealthy, and
the suggested action is to restart the job from its last good checkpoint. No checkpoint is
ordered for it (:mod:`forewarn.agent.orders`): saving a NaN state is useless and would
push a good checkpoint out of a keep-last-N rotation.

A non-finite grad norm with a finite loss is routine under mixed precision: the dynamic
loss scaler (torch.amp.GradScaler) skips that optimizer step and lowers the scale. One or
two in a row are degraded (watch); ``grad_streak`` (3) in a row means the scaler is not
recovering: unhealthy.

The ingest thread marks the first bad step as it arrives; the agent's rank component
publishes the finding at once (sub-second), and this check keeps it current every poll.
"""

from __future__ import annotations

from forewarn.agent.checks.common import RankCheck
from forewarn.agent.rank_state import RankView, rank_finding
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["NanLossCheck", "judge_nan"]


def judge_nan(view: RankView, node: str, now: float, grad_streak: int = 3) -> Finding:
    """The nan_loss finding for one rank (healthy when nothing is non-finite)."""
    if view.nonfinite_loss_step is not None:
        return rank_finding(
            NanLossCheck.name, view, node, now, Health.UNHEALTHY,
            f"rank {view.rank} of job {view.job}: loss is {view.loss} since step "
            f"{view.nonfinite_loss_step}: the model state is poisoned; restart from the last "
            "good checkpoint (do not save this state)",
            SuggestedAction.RESTART_JOB,
            {"bad_step": view.nonfinite_loss_step, "loss": str(view.loss)},
        )
    if view.nonfinite_grad_step is not None:
        bad = view.nonfinite_grad_streak >= grad_streak
        return rank_finding(
            NanLossCheck.name, view, node, now,
            Health.UNHEALTHY if bad else Health.DEGRADED,
            f"rank {view.rank} of job {view.job}: grad norm {view.grad_norm} for "
            f"{view.nonfinite_grad_streak} step(s) since step {view.nonfinite_grad_step}"
            + ("" if bad else " (a mixed-precision loss scaler skips such steps)"),
            SuggestedAction.RESTART_JOB if bad else SuggestedAction.WATCH,
            {"bad_step": view.nonfinite_grad_step, "grad_norm": str(view.grad_norm),
             "streak": view.nonfinite_grad_streak},
        )
    return rank_finding(NanLossCheck.name, view, node, now, Health.HEALTHY,
                        f"rank {view.rank} of job {view.job}: loss finite")


class NanLossCheck(RankCheck):
    """Non-finite loss (unhealthy) or grad norm (degraded, unhealthy when it persists)."""

    name = "nan_loss"

    def __init__(self, *, grad_streak: int = 3) -> None:
        self.grad_streak = grad_streak

    def run(self, state: AgentState, now: float) -> list[Finding]:
        if state.ranks is None:
            return []
        return [judge_nan(v, state.node, now, self.grad_streak)
                for v in state.ranks.views() if v.steps_total > 0]
