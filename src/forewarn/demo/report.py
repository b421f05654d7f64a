"""The demo's report: :class:`DemoResult`, what :mod:`forewarn.demo.run` measured, with the
loss the same run would have without forewarn, and :func:`summary_lines`, its printed
summary."""

from __future__ import annotations

import dataclasses

__all__ = ["NCCL_TIMEOUT_S", "DemoResult", "summary_lines"]

NCCL_TIMEOUT_S = 600.0


@dataclasses.dataclass
class DemoResult:
    """What happened, as measured; the summary prints it and the tests assert on it."""

    url: str = ""
    workdir: str = ""
    failure_step: int | None = None
    failure_time: float | None = None
    order_time: float | None = None
    order_reason: str = ""
    ordered_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    resumed_step: int | None = None
    resumed_ranks: dict[int, int] = dataclasses.field(default_factory=dict)
    last_periodic_step: int | None = None
    hang_injected: float | None = None
    hang_detected: float | None = None
    hang_resumed_step: int | None = None
    nan_step: int | None = None
    nan_detected_step: int | None = None
    nan_detected_latency_s: float | None = None
    nan_resumed_step: int | None = None
    mean_step_s: float | None = None
    restarts: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def lead_s(self) -> float | None:
        if self.failure_time is None or self.order_time is None:
            return None
        return self.failure_time - self.order_time

    @property
    def checkpoint_step(self) -> int | None:
        steps = set(self.ordered_steps.values())
        return steps.pop() if len(steps) == 1 else None

    @property
    def steps_lost(self) -> int | None:
        if self.failure_step is None or self.resumed_step is None:
            return None
        return self.failure_step - self.resumed_step

    @property
    def steps_lost_without(self) -> int | None:
        """Without forewarn: back to the last periodic checkpoint, plus NCCL's timeout."""
        if self.failure_step is None or not self.mean_step_s:
            return None
        base = self.last_periodic_step or 0
        return self.failure_step - base + int(NCCL_TIMEOUT_S / self.mean_step_s)

    @property
    def hang_latency_s(self) -> float | None:
        if self.hang_injected is None or self.hang_detected is None:
            return None
        return self.hang_detected - self.hang_injected


def summary_lines(r: DemoResult) -> list[str]:
    def f(x: float | None, unit: str = "s", digits: int = 1) -> str:
        return "n/a" if x is None else f"{x:.{digits}f} {unit}"

    lines = [
        f"prediction lead time      {f(r.lead_s)} before the double-bit error "
        f"({r.order_reason or 'no order seen'})",
        f"checkpoint step           {r.checkpoint_step} on every rank "
        f"{sorted(r.ordered_steps.items())}",
        f"restart resumed from      step {r.resumed_step} (failure at step {r.failure_step})",
        f"steps lost with forewarn  {r.steps_lost}",
        f"without forewarn          {r.steps_lost_without} steps (back to periodic checkpoint "
        f"{r.last_periodic_step or 0} plus {NCCL_TIMEOUT_S:.0f} s NCCL timeout at "
        f"{f(r.mean_step_s, digits=2)}/step)",
        f"hang detected after       {f(r.hang_latency_s)} (NCCL timeout: {NCCL_TIMEOUT_S:.0f} s)",
        f"NaN caught at step        {r.nan_detected_step} (injected at {r.nan_step}), "
        f"rolled back to step {r.nan_resumed_step}",
        f"restarts                  {r.restarts}",
    ]
    lines += [f"problem: {p}" for p in r.problems]
    return lines
