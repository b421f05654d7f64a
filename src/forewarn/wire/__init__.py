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

Import records from here (``from forewarn.wire import GpuSample``); the submodules only
organise them: :mod:`.base` (version, ranges, enums), :mod:`.training` (hook <-> agent),
:mod:`.node` (agent <-> collector), :mod:`.codec` (encoding and decoding).
"""

from __future__ import annotations

from .base import (
    INT64_MAX,
    MAX_UNIX_TIME,
    WIRE_VERSION,
    GpuState,
    Health,
    SuggestedAction,
    WireError,
)
from .codec import (
    DECODE_ERRORS,
    SENT_AT_HEADER,
    decode,
    decode_agent_message,
    decode_error_message,
    decode_hook_message,
    decode_json,
    decode_order,
    encode,
    encode_json,
)
from .node import (
    AgentBatch,
    Command,
    CommandAck,
    Evidence,
    Finding,
    GpuSample,
    NvlinkCounters,
    RankSummary,
    Subject,
    XidEvent,
)
from .training import (
    PREEMPTED,
    AgentMessage,
    Beat,
    CheckpointOrder,
    CheckpointReport,
    HookMessage,
    IntervalAdvice,
    SaveHold,
    StepRecord,
)

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
    "Evidence",
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
