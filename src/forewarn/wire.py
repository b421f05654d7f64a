"""Records that cross a process boundary, defined once.

Every record is a :class:`msgspec.Struct` carrying the wire version ``v``.  Decoding
validates types and ranges and raises :class:`WireError` whose message names the field
(``Expected `int`, got `str` - at `$.step```).  Ranges that protect storage hold for every
record: integers fit in int64 (:data:`INT64_MAX`), times are Unix seconds before 2100
(:data:`MAX_UNIX_TIME`), GPU measurements are finite; input nested deeper than the
decoder's limit is a :class:`WireError` too.  Nothing else is shared between the parts of
forewarn.

Encodings:

* hook <-> agent datagrams: msgpack (:func:`encode` / :func:`decode_hook_message`,
  :func:`decode_order`); msgpack keeps NaN and Inf, which a NaN-loss detector needs.
* agent -> collector batches: msgpack over HTTP (``application/msgpack``).
* collector API and webhooks: JSON (non-finite floats become ``null``).
"""

from __future__ import annotations

import enum
import sys
from typing import Annotated, Any, Final, TypeVar

import msgspec
from msgspec import Meta, Struct, field

from forewarn.errors import InputError

__all__ = [
    "DECODE_ERRORS",
    "INT64_MAX",
    "MAX_UNIX_TIME",
    "PREEMPTED",
    "SENT_AT_HEADER",
    "WIRE_VERSION",
    "AgentBatch",
    "AgentMessage",
    "Beat",
    "CheckpointOrder",
    "CheckpointReport",
    "Command",
    "CommandAck",
    "Finding",
    "GpuSample",
    "GpuState",
    "Health",
    "HookMessage",
    "IntervalAdvice",
    "NvlinkCounters",
    "RankSummary",
    "SaveHold",
    "StepRecord",
    "Subject",
    "SuggestedAction",
    "WireError",
    "XidEvent",
    "decode",
    "decode_agent_message",
    "decode_error_message",
    "decode_hook_message",
    "decode_json",
    "decode_order",
    "encode",
    "encode_json",
]

WIRE_VERSION: Final = 1
"""Current wire version. Decoders accept versions 1..WIRE_VERSION."""

INT64_MAX: Final = 2**63 - 1
"""Largest integer any record carries: SQLite INTEGER and Parquet int64 hold no more (a
counter at NVML's 2**64-1 "not available" sentinel would wedge every Parquet flush)."""
MAX_UNIX_TIME: Final = 4_102_444_800.0
"""2100-01-01 in Unix seconds: any time past it is a unit error (milliseconds) or garbage."""
_FLOAT_MAX: Final = sys.float_info.max

Version = Annotated[int, Meta(ge=1, le=WIRE_VERSION)]
NonNegInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Rank = Annotated[int, Meta(ge=0, le=1_000_000)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
Text = Annotated[str, Meta(max_length=4096)]
# msgspec has no "finite" constraint; bounds at the largest float refuse NaN and +-Inf.
Finite = Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
Seconds = Annotated[float, Meta(ge=0.0, le=_FLOAT_MAX)]
Ratio = Annotated[float, Meta(ge=0.0, le=1.0)]
Rate = Annotated[float, Meta(ge=0.0, le=_FLOAT_MAX)]
UnixTime = Annotated[float, Meta(ge=0.0, le=MAX_UNIX_TIME)]
PhaseName = Annotated[str, Meta(max_length=32)]


class WireError(InputError, ValueError):
    """A record failed to decode; the message names the offending field."""


class Health(enum.StrEnum):
    """Health of a subject, from best to worst (unknown: could not tell)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    UNKNOWN = "unknown"

    @property
    def severity(self) -> int:
        """Order for "worst of": healthy 0 < unknown 1 < degraded 2 < unhealthy 3."""
        return _SEVERITY[self]


_SEVERITY: dict[Health, int] = {Health.HEALTHY: 0, Health.UNKNOWN: 1, Health.DEGRADED: 2,
                                 Health.UNHEALTHY: 3}


class SuggestedAction(enum.StrEnum):
    """What a person or the policy should do about a finding."""

    NONE = "none"
    WATCH = "watch"
    CHECKPOINT = "checkpoint"
    RESTART_JOB = "restart_job"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    DRAIN = "drain"
    INSPECT_HARDWARE = "inspect_hardware"


class GpuState(enum.StrEnum):
    """Whether the GPU answered this poll (NVML_ERROR_GPU_IS_LOST etc. map here)."""

    OK = "ok"
    LOST = "lost"
    RESET_REQUIRED = "reset_required"


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


class StepRecord(Struct, frozen=True, kw_only=True, tag="step"):
    """hook -> agent: one training step of one rank. ``loss`` may be NaN or Inf."""

    v: Version = WIRE_VERSION
    job: Name
    rank: Rank
    local_rank: Rank = 0
    world_size: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    pid: Annotated[int, Meta(ge=1, le=INT64_MAX)]
    host: Name
    step: NonNegInt
    time: UnixTime
    step_seconds: Seconds | None = None
    loss: float | None = None
    grad_norm: float | None = None
    extras: dict[Annotated[str, Meta(max_length=64)], float] = field(default_factory=dict)


class Beat(Struct, frozen=True, kw_only=True, tag="beat"):
    """hook -> agent: liveness from the rank's background thread, sent even when stuck."""

    v: Version = WIRE_VERSION
    job: Name
    rank: Rank
    local_rank: Rank = 0
    world_size: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    pid: Annotated[int, Meta(ge=1, le=INT64_MAX)]
    host: Name
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

    A rank that has already reported ``step`` when the hold arrives holds from its next step
    and reports ``missed`` (a :class:`CheckpointReport` with the hold's ``request_id`` and
    its current step); whoever issued the hold issues it again past that step (the ordering
    rule's ``floor``), with ``replaces`` naming the hold it replaces: every rank then holds
    from the new ``step`` instead."""

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


T = TypeVar("T")

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_hook_decoder: msgspec.msgpack.Decoder[StepRecord | Beat | CheckpointReport] = (
    msgspec.msgpack.Decoder(HookMessage)
)
_order_decoder = msgspec.msgpack.Decoder(CheckpointOrder)
_agent_decoder: msgspec.msgpack.Decoder[CheckpointOrder | IntervalAdvice | SaveHold] = (
    msgspec.msgpack.Decoder(AgentMessage)
)


def encode(record: Any) -> bytes:
    """Encode a record (or list of records) as msgpack."""
    return _msgpack_encoder.encode(record)


def encode_json(record: Any) -> bytes:
    """Encode a record as JSON; NaN and Inf become ``null``."""
    return _json_encoder.encode(record)


SENT_AT_HEADER: Final = "forewarn-sent-at"
"""HTTP header of an agent's batch upload: the agent's Unix time when it sent the request
(the collector measures each agent's clock skew from it)."""

DECODE_ERRORS: Final = (msgspec.ValidationError, msgspec.DecodeError, RecursionError,
                        UnicodeDecodeError)
"""What msgspec raises on bad input. RecursionError: nesting deeper than the decoder's
limit (Python's recursion limit, ~1,000 levels), even inside a field it would skip;
UnicodeDecodeError: a msgpack string that is not UTF-8."""


def decode_error_message(exc: Exception, what: str) -> str:
    """The :class:`WireError` message for ``exc`` (one of :data:`DECODE_ERRORS`)."""
    if isinstance(exc, RecursionError):
        return f"invalid {what}: nested too deeply (more than ~1,000 levels of arrays/maps)"
    return f"invalid {what}: {exc}"


def _wrap(exc: Exception, what: str) -> WireError:
    return WireError(decode_error_message(exc, what))


def decode(data: bytes, type: type[T]) -> T:
    """Decode msgpack ``data`` as ``type``; :class:`WireError` names the bad field."""
    try:
        return msgspec.msgpack.decode(data, type=type)
    except DECODE_ERRORS as exc:
        raise _wrap(exc, type.__name__) from None


def decode_json(data: bytes | str, type: type[T]) -> T:
    """Decode JSON ``data`` as ``type``; :class:`WireError` names the bad field."""
    try:
        return msgspec.json.decode(data, type=type)
    except DECODE_ERRORS as exc:
        raise _wrap(exc, type.__name__) from None


def decode_hook_message(data: bytes) -> StepRecord | Beat | CheckpointReport:
    """Decode one hook datagram."""
    try:
        return _hook_decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise _wrap(exc, "hook message") from None


def decode_agent_message(data: bytes) -> CheckpointOrder | IntervalAdvice | SaveHold:
    """Decode one agent -> hook datagram (an order, interval advice or a save hold)."""
    try:
        return _agent_decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise _wrap(exc, "agent message") from None


def decode_order(data: bytes) -> CheckpointOrder:
    """Decode one checkpoint order datagram (agent -> hook)."""
    try:
        return _order_decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise _wrap(exc, "checkpoint order") from None
