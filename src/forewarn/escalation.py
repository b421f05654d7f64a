"""When a finding about the same thing is *worse* than the one before: the one rule the agent
(re-report an unchanged finding) and the collector (order again within one incident) share.

A finding escalates its predecessor of the same check and subject when

* its health is worse (:attr:`forewarn.wire.Health.severity`), or
* it has the same health and its **extent** grew materially: a check that counts how much
  of a fault there is (remapped rows, retired pages, uncorrectable errors) puts that count
  in ``evidence["extent"]`` (:data:`EXTENT`), and the count grew by at least
  :data:`MATERIAL_GROWTH` of its previous value and by at least one.

Why extent matters: a row-remap finding stays "degraded, remap pending" while the remapped
rows grow from 1 to 8 and the bank runs out of spares (issue 14's ``row_remap_failure``
chaos scenario). Without it the agent re-sent nothing, the collector ordered once, and the
job lost about 70 % of its progress when the remap finally failed. 25 % keeps a slow drift of
a large count (thousands of correctable errors) from ordering at every poll, while each of the
first few rows of a small count still counts.
"""

from __future__ import annotations

from forewarn.wire import Finding, Health

__all__ = ["EXTENT", "MATERIAL_GROWTH", "escalates", "extent"]

EXTENT = "extent"
"""Evidence key: how much of the fault there is, a count that only grows while it lasts."""
MATERIAL_GROWTH = 0.25
"""Relative growth of the extent that counts as materially worse."""


def extent(finding: Finding) -> float | None:
    """The finding's extent (``evidence["extent"]``), or None when it has none."""
    value = finding.evidence.get(EXTENT)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def escalates(old: Finding, new: Finding) -> bool:
    """Whether ``new`` is materially worse than ``old`` (see the module docstring). Findings
    of different checks or subjects never escalate one another."""
    if old.check != new.check or old.subject.key() != new.subject.key():
        return False
    if new.health.severity != old.health.severity:
        return new.health.severity > old.health.severity
    if new.health == Health.HEALTHY:
        return False
    before, after = extent(old), extent(new)
    if after is None:
        return False
    if before is None:
        return after > 0
    return after - before >= max(1.0, MATERIAL_GROWTH * before)
