"""Records a node agent sends the collector (and the commands it gets back): GPU samples,
XID events, findings, rank summaries, batches."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct, field

from .base import (
    INT64_MAX,
    WIRE_VERSION,
    Finite,
    GpuState,
    Health,
    Name,
    NonNegInt,
    PhaseName,
    Rank,
    Rate,
    Ratio,
    Seconds,
    SuggestedAction,
    Text,
    UnixTime,
    Version,
)
from .training import CheckpointOrder, CheckpointReport, IntervalAdvice, SaveHold


class NvlinkCounters(Struct, frozen=True, kw_only=True):
    """Cumulative NVLink error counters of one link (NVML_NVLINK_ERROR_DL_*)."""

    link: NonNegInt
    crc_flit: NonNegInt | None = None
    crc_data: NonNegInt | None = None
    replay: NonNegInt | None = None
    recovery: NonNegInt | None = None


class GpuSample(Struct, frozen=True, kw_only=True):
    """One poll of one GPU. ``None`` means not read: see ``unsupported`` for why.

    Measurements are finite, counters fit in int64 and ``time`` is Unix seconds (the
    decoder refuses anything else, naming the field).

    Counters (``*_total`` style fields) are cumulative as NVML reports them. This is also
    the replay schema: one row per GPU per sample time, columns named as these fields.
    """

    v: Version = WIRE_VERSION
    node: Name
    gpu: NonNegInt
    uuid: Annotated[str, Meta(max_length=128)] = ""
    pci_bus_id: Annotated[str, Meta(max_length=64)] = ""
    name: Annotated[str, Meta(max_length=128)] = ""
    time: UnixTime
    source: Annotated[str, Meta(max_length=32)]
    simulated: bool = False
    state: GpuState = GpuState.OK
    temperature_c: Finite | None = None
    memory_temperature_c: Finite | None = None
    slowdown_margin_c: Finite | None = None
    power_w: Finite | None = None
    power_limit_w: Finite | None = None
    sm_clock_mhz: Finite | None = None
    mem_clock_mhz: Finite | None = None
    gpu_util_pct: Finite | None = None
    mem_util_pct: Finite | None = None
    memory_used_bytes: NonNegInt | None = None
    memory_total_bytes: NonNegInt | None = None
    throttle_reasons: NonNegInt | None = None
    ecc_corrected_volatile: NonNegInt | None = None
    ecc_uncorrected_volatile: NonNegInt | None = None
    ecc_corrected_aggregate: NonNegInt | None = None
    ecc_uncorrected_aggregate: NonNegInt | None = None
    retired_pages_sbe: NonNegInt | None = None
    retired_pages_dbe: NonNegInt | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: NonNegInt | None = None
    remapped_rows_uncorrectable: NonNegInt | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    pcie_replay_total: NonNegInt | None = None
    pcie_link_gen: NonNegInt | None = None
    pcie_link_gen_max: NonNegInt | None = None
    pcie_link_width: NonNegInt | None = None
    pcie_link_width_max: NonNegInt | None = None
    nvlink: tuple[NvlinkCounters, ...] = ()
    pstate: NonNegInt | None = None
    energy_mj: NonNegInt | None = None
    """Energy used since the driver loaded, millijoules: a counter
    (nvmlDeviceGetTotalEnergyConsumption, Volta and later; DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION)."""
    # Profiling fields (DCGM's DCP metrics: dcgm-exporter's DCGM_FI_PROF_*, averaged by DCGM
    # over its sampling period); NVML does not read them.
    sm_active: Ratio | None = None
    """Share of cycles an SM has at least one warp assigned (DCGM_FI_PROF_SM_ACTIVE)."""
    tensor_active: Ratio | None = None
    """Share of cycles the tensor (HMMA) pipe is active (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)."""
    dram_active: Ratio | None = None
    """Share of cycles the memory interface sends or receives (DCGM_FI_PROF_DRAM_ACTIVE)."""
    pcie_tx_bytes_per_s: Rate | None = None
    """PCIe bytes sent per second, headers included (DCGM_FI_PROF_PCIE_TX_BYTES)."""
    pcie_rx_bytes_per_s: Rate | None = None
    """PCIe bytes received per second (DCGM_FI_PROF_PCIE_RX_BYTES)."""
    nvlink_tx_bytes_per_s: Rate | None = None
    """NVLink bytes sent per second, all links (DCGM_FI_PROF_NVLINK_TX_BYTES)."""
    nvlink_rx_bytes_per_s: Rate | None = None
    """NVLink bytes received per second, all links (DCGM_FI_PROF_NVLINK_RX_BYTES)."""
    unsupported: tuple[str, ...] = ()
    """Fields this GPU does not support (NVML_ERROR_NOT_SUPPORTED): not errors."""
    errors: tuple[str, ...] = ()
    """``field: reason`` for fields that failed for another reason this poll."""


class XidEvent(Struct, frozen=True, kw_only=True):
    """An NVIDIA XID error: from an NVML event set, the kernel log or a replay."""

    v: Version = WIRE_VERSION
    node: Name
    gpu: NonNegInt | None = None
    pci_bus_id: Annotated[str, Meta(max_length=64)] = ""
    code: Annotated[int, Meta(ge=0, le=100_000)]
    text: Text = ""
    time: UnixTime
    source: Annotated[str, Meta(max_length=32)]
    simulated: bool = False


class Subject(Struct, frozen=True, kw_only=True):
    """What a finding is about: a GPU, a node, a rank of a job, or a whole job."""

    kind: Annotated[str, Meta(pattern="^(gpu|node|rank|job)$")]
    node: Annotated[str, Meta(max_length=256)] = ""
    gpu: NonNegInt | None = None
    job: Annotated[str, Meta(max_length=256)] = ""
    rank: NonNegInt | None = None

    def key(self) -> str:
        """A stable string for dedup and cooldown: ``gpu:node7/3``, ``rank:job42/5``."""
        if self.kind == "gpu":
            return f"gpu:{self.node}/{self.gpu}"
        if self.kind == "node":
            return f"node:{self.node}"
        if self.kind == "rank":
            return f"rank:{self.job}/{self.rank}"
        return f"job:{self.job}"


Evidence = dict[Annotated[str, Meta(max_length=64)], float | int | str | bool | None]


class Finding(Struct, frozen=True, kw_only=True):
    """The result of a check or detector about one subject.

    ``probability`` is set by predictors: P(failure of the subject within ``horizon_s``).
    """

    v: Version = WIRE_VERSION
    check: Name
    health: Health
    subject: Subject
    reason: Text
    action: SuggestedAction = SuggestedAction.NONE
    evidence: Evidence = field(default_factory=dict)
    time: UnixTime
    probability: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    horizon_s: Seconds | None = None
    simulated: bool = False


class RankSummary(Struct, frozen=True, kw_only=True):
    """agent -> collector: what the agent knows of one rank on its node."""

    v: Version = WIRE_VERSION
    job: Name
    rank: Rank
    local_rank: Rank = 0
    world_size: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    node: Name
    gpu: NonNegInt | None = None
    pid: Annotated[int, Meta(ge=1, le=INT64_MAX)]
    last_step: NonNegInt | None = None
    last_step_time: UnixTime | None = None
    last_beat: UnixTime | None = None
    step_seconds_p50: Seconds | None = None
    step_seconds_p99: Seconds | None = None
    loss: float | None = None
    grad_norm: float | None = None
    alive: bool = True
    compute_seconds_p50: Seconds | None = None
    """Median of the rank's last few compute times per step (the hook's
    ``compute_seconds`` extra): who is slow in synchronous data parallelism, where every
    rank's wall step time is equal. None when the hook does not report it."""
    last_checkpoint_step: NonNegInt | None = None
    last_checkpoint_time: UnixTime | None = None
    checkpoint_seconds: Seconds | None = None
    finished: bool = False
    """The rank ended cleanly (``alive`` is then False): not gone, not hung."""
    phase: PhaseName = ""
    """The phase the rank reported last (empty: training steps)."""


class AgentBatch(Struct, frozen=True, kw_only=True):
    """agent -> collector: everything since the last batch. ``seq`` is per agent and
    strictly increasing, so the collector stores each batch exactly once."""

    v: Version = WIRE_VERSION
    node: Name
    agent_id: Name
    seq: NonNegInt
    created: UnixTime
    urgent: bool = False
    samples: list[GpuSample] = field(default_factory=list)
    xids: list[XidEvent] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    ranks: list[RankSummary] = field(default_factory=list)
    checkpoints: list[CheckpointReport] = field(default_factory=list)


class Command(Struct, frozen=True, kw_only=True):
    """collector -> agent over the long poll. ``kind``: ``checkpoint`` (with ``order``),
    ``advice`` (with ``advice``), ``hold`` (with ``hold``) or ``probe``."""

    v: Version = WIRE_VERSION
    id: Annotated[str, Meta(min_length=1, max_length=128)]
    kind: Annotated[str, Meta(pattern="^(checkpoint|probe|advice|hold)$")]
    order: CheckpointOrder | None = None
    advice: IntervalAdvice | None = None
    hold: SaveHold | None = None
    issued: UnixTime


class CommandAck(Struct, frozen=True, kw_only=True):
    """agent -> collector: the agent received (and passed on) a command."""

    v: Version = WIRE_VERSION
    id: Annotated[str, Meta(min_length=1, max_length=128)]
    node: Name
    ok: bool = True
    detail: Text = ""
    time: UnixTime
