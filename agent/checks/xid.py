"""XID check: classify NVIDIA XID errors and escalate repeats.

Classes follow NVIDIA's XID catalog as public tools classify it (docs/reference.md, "XID
classes"): application-level codes (13, 31, 43, 45) say the *job* hit an error, not the
GPU, and never make a GPU unhealthy; the Summit counts show they dominate raw counts, so
counting all XIDs alike misleads. Hardware classes: memory (48 double-bit ECC, 63/64 row
remap / page retirement event and failure, 92 high single-bit rate, 94 contained and
95 uncontained ECC error), interconnect (74 NVLink), bus (79 fallen off the bus) and the
GPU system processor (119/120 GSP timeout / error).

Health of a GPU is the worst XID seen in the last ``active_s`` seconds. Repeated fatal
XIDs on one GPU within ``repeat_window_s`` (default 24 h) escalate from reset/reboot to
"inspect hardware" (docs/reference.md: >= 5 in 24 h). XIDs whose bus id maps to no GPU are
judged on the node.
"""

from __future__ import annotations

from collections import Counter

from forewarn.agent.checks.common import gpu_finding
from forewarn.agent.state import AgentState
from forewarn.gpu import classify_xid
from forewarn.wire import Finding, Health, Subject, SuggestedAction, XidEvent

__all__ = ["XidCheck"]


class XidCheck:
    """Judges every GPU (healthy too) and the node (for unmapped XIDs) from recent XIDs.

    Args:
        active_s: an XID decides the health for this long (default 1 h); afterwards it
            only counts toward escalation. A GPU reset or a node reboot within that
            time is not visible to the agent, so keep it short.
        repeat_window_s: window for repeat escalation (default 24 h, docs/reference.md).
        repeat_fatal: fatal XIDs on one GPU within the window that escalate to
            unhealthy + inspect_hardware (default 5, docs/reference.md).
    """

    name = "xid"

    def __init__(
        self, active_s: float = 3600.0, repeat_window_s: float = 24 * 3600.0, repeat_fatal: int = 5
    ) -> None:
        self.active_s = active_s
        self.repeat_window_s = repeat_window_s
        self.repeat_fatal = repeat_fatal

    def applies(self, state: AgentState) -> bool:
        return True

    def run(self, state: AgentState, now: float) -> list[Finding]:
        by_gpu: dict[int | None, list[XidEvent]] = {}
        for ev in state.xids:
            if ev.time >= now - self.repeat_window_s:
                gpu = ev.gpu if ev.gpu in state.gpus else None
                by_gpu.setdefault(gpu, []).append(ev)
        findings = []
        for index, hist in sorted(state.gpus.items()):
            health, action, reason, evidence = self._judge(by_gpu.get(index, []), now)
            findings.append(gpu_finding(self.name, state, hist, now, health, reason, action,
                                        evidence))
        unmapped = by_gpu.get(None, [])
        if unmapped:
            health, action, reason, evidence = self._judge(unmapped, now)
            findings.append(Finding(
                check=self.name, health=health, subject=Subject(kind="node", node=state.node),
                reason=f"on a GPU the agent could not map: {reason}", action=action,
                evidence=evidence, time=now, simulated=any(e.simulated for e in unmapped),
            ))
        return findings

    def _judge(
        self, events: list[XidEvent], now: float
    ) -> tuple[Health, SuggestedAction, str, dict[str, float | int | str | bool | None]]:
        if not events:
            return Health.HEALTHY, SuggestedAction.NONE, "no XID errors in the last 24 h", {}
        fatal = [e for e in events if classify_xid(e.code).fatal]
        active = [e for e in events if e.time >= now - self.active_s]
        counts = Counter(e.code for e in events)
        seen = ", ".join(f"XID {c} x{n}" for c, n in sorted(counts.items()))
        evidence: dict[str, float | int | str | bool | None] = {
            "fatal_24h": len(fatal), "xids_24h": len(events), "codes": seen[:200],
        }
        if len(fatal) >= self.repeat_fatal:
            evidence["last_code"] = fatal[-1].code
            return (Health.UNHEALTHY, SuggestedAction.INSPECT_HARDWARE,
                    f"{len(fatal)} fatal XIDs within {self.repeat_window_s / 3600:g} h "
                    f"(>= {self.repeat_fatal}): resetting again will not help, inspect the "
                    f"hardware ({seen})", evidence)
        worst: XidEvent | None = None
        for e in active:
            if worst is None or (classify_xid(e.code).health.severity
                                 >= classify_xid(worst.code).health.severity):
                worst = e
        if worst is None:
            return (Health.HEALTHY, SuggestedAction.NONE,
                    f"no XID in the last {self.active_s / 60:g} min ({seen} within 24 h)",
                    evidence)
        c = classify_xid(worst.code)
        evidence["last_code"] = worst.code
        if c.health == Health.HEALTHY:
            reason = (f"XID {worst.code} ({c.meaning}) is application-class: the job hit an "
                      f"error, the GPU is fine ({seen} within 24 h)")
        else:
            reason = f"XID {worst.code} ({c.cls}: {c.meaning}); {seen} within 24 h"
        return c.health, c.action, reason, evidence
