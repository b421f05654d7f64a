"""Grad-norm spike: a finite grad norm above ``factor`` × the rank's rolling median.

Default factor 10 (a common abort/checkpoint trigger, docs/reference.md "Grad-norm monitoring").
The median runs over the rank's last 256 finite grad norms (at least 8 before it judges);
the spike itself is kept out of the baseline. The factor is the rank table's
(``RankTable.spike_factor``, AgentConfig ``grad_spike_factor``) because the ingest thread
marks the spike as the step arrives.

A spike is unhealthy with a checkpoint suggested: the state is still finite, and a spike
often precedes divergence, so the newest finite state is worth saving (tagged with the
reason, next to the older periodic checkpoints; PaLM-style recovery rolls back before the
spike and skips batches). The finding holds for ``hold_steps`` steps after the spike.
"""

from __future__ import annotations

from forewarn.agent.checks.common import RankCheck
from forewarn.agent.rank_state import RankView, rank_finding
from forewarn.agent.state import AgentState
from forewarn.wire import Finding, Health, SuggestedAction

__all__ = ["GradSpikeCheck", "judge_spike"]


def judge_spike(view: RankView, node: str, now: float, factor: float, hold_steps: int = 50
                ) -> Finding:
    """The grad_spike finding for one rank."""
    if (
        view.spike_step is not None
        and view.last_step is not None
        and view.last_step - view.spike_step <= hold_steps
    ):
        ratio = (view.spike_value or 0.0) / (view.spike_median or 1.0)
        return rank_finding(
            GradSpikeCheck.name, view, node, now, Health.UNHEALTHY,
            f"rank {view.rank} of job {view.job}: grad norm {view.spike_value:.4g} at step "
            f"{view.spike_step} is {ratio:.1f}x its rolling median {view.spike_median:.4g} "
            f"(threshold {factor:g}x)",
            SuggestedAction.CHECKPOINT,
            {"bad_step": view.spike_step, "grad_norm": view.spike_value,
             "median": view.spike_median, "ratio": round(ratio, 3)},
        )
    return rank_finding(GradSpikeCheck.name, view, node, now, Health.HEALTHY,
                        f"rank {view.rank} of job {view.job}: grad norm within {factor:g}x median",
                        evidence={"median": view.grad_norm_median})


class GradSpikeCheck(RankCheck):
    """Grad norm above ``factor`` × rolling median (factor from the rank table)."""

    name = "grad_spike"

    def __init__(self, *, hold_steps: int = 50) -> None:
        self.hold_steps = hold_steps

    def run(self, state: AgentState, now: float) -> list[Finding]:
        table = state.ranks
        if table is None:
            return []
        return [judge_spike(v, state.node, now, table.spike_factor, self.hold_steps)
                for v in table.views() if v.grad_norm_samples > 0 or v.spike_step is not None]
