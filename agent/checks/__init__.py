"""Checks: one module each, all of them listed in :data:`ALL_CHECKS` (no import magic).

Each entry is a check class whose constructor takes only keyword thresholds with
documented defaults; :func:`default_checks` builds one of each with those defaults.
"""

from __future__ import annotations

from forewarn.agent.checks.base import Check
from forewarn.agent.checks.ecc import EccCheck
from forewarn.agent.checks.gpu_lost import GpuLostCheck
from forewarn.agent.checks.grad_spike import GradSpikeCheck
from forewarn.agent.checks.nan_loss import NanLossCheck
from forewarn.agent.checks.nvlink import NvlinkCheck
from forewarn.agent.checks.pcie import PcieCheck
from forewarn.agent.checks.power_brake import PowerBrakeCheck
from forewarn.agent.checks.rank_gone import RankGoneCheck
from forewarn.agent.checks.rank_hang import RankHangCheck
from forewarn.agent.checks.remap import RemapCheck
from forewarn.agent.checks.retired_pages import RetiredPagesCheck
from forewarn.agent.checks.straggler import StragglerCheck
from forewarn.agent.checks.thermal import ThermalCheck
from forewarn.agent.checks.xid import XidCheck

__all__ = ["ALL_CHECKS", "default_checks"]

ALL_CHECKS: tuple[type[Check], ...] = (
    # GPU hardware (read AgentState.gpus / xids)
    GpuLostCheck,
    XidCheck,
    EccCheck,
    RemapCheck,
    RetiredPagesCheck,
    ThermalCheck,
    PowerBrakeCheck,
    PcieCheck,
    NvlinkCheck,
    # training ranks (read AgentState.ranks; they apply once a rank has reported)
    RankHangCheck,
    RankGoneCheck,
    NanLossCheck,
    GradSpikeCheck,
    StragglerCheck,
)


def default_checks() -> list[Check]:
    """One instance of every check in :data:`ALL_CHECKS`, with default thresholds."""
    return [cls() for cls in ALL_CHECKS]
