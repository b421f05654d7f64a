"""Agent batches at the wire boundary: decode, bound and validate a request body
(:func:`check_batch`) before anything is stored.

A bad *record* (one sample, XID, finding, rank summary or checkpoint report: a wrong type,
a value out of range, NaN/Inf, a time outside the window around the collector's clock) is
left out and reported (:class:`Refusal`: the field, ``$.samples[3].power_w``, and why), and
the rest of the batch is stored: one broken sensor never costs a node its findings. A bad
*batch* (its own fields, undecodable bytes, another node's identity) is refused whole with
a 4xx (:class:`IngestError`). Storing is :mod:`.batch`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from forewarn.errors import InputError
from forewarn.wire import (
    DECODE_ERRORS,
    AgentBatch,
    CheckpointReport,
    Finding,
    GpuSample,
    RankSummary,
    XidEvent,
    decode_error_message,
    encode,
)

from ..metrics import CollectorMetrics

__all__ = ["CheckedBatch", "IngestError", "Refusal", "TimeWindow", "check_batch",
           "count_refusals", "count_rejection"]

log = logging.getLogger(__name__)

_batch_decoder = msgspec.msgpack.Decoder(AgentBatch)
_RECORDS: dict[str, type[Any]] = {"samples": GpuSample, "xids": XidEvent, "findings": Finding,
                                  "ranks": RankSummary, "checkpoints": CheckpointReport}
"""The record lists of a batch and their types: each record is refused on its own."""
_record_decoders = {name: msgspec.msgpack.Decoder(t) for name, t in _RECORDS.items()}


def _envelope_fields() -> list[Any]:
    """AgentBatch's fields with each record list left undecoded (``msgspec.Raw``)."""
    out: list[Any] = []
    for f in msgspec.structs.fields(AgentBatch):
        if f.name in _RECORDS:
            out.append((f.name, list[msgspec.Raw], msgspec.field(default_factory=list)))
        else:
            out.append((f.name, f.type) if f.required else (f.name, f.type, f.default))
    return out


_envelope_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    msgspec.defstruct("_BatchEnvelope", _envelope_fields(), kw_only=True))


class IngestError(InputError, ValueError):
    """A request was refused; ``status`` is the HTTP status, the message names the problem."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One record left out of a batch. ``reason`` (a metric label) is ``time`` (outside
    the window, or not Unix seconds), ``non_finite`` (NaN/Inf), ``range`` (a number out of
    its range) or ``type`` (anything else the decoder refused)."""

    record: str
    field: str
    reason: str
    message: str

    def as_json(self) -> dict[str, str]:
        return {"field": self.field, "reason": self.reason, "error": self.message}


@dataclasses.dataclass(frozen=True)
class TimeWindow:
    """Record times accepted: ``max_age_s`` before the collector's clock ``now`` up to
    ``max_future_s`` after it. A future time would freeze a GPU's latest row (later real
    samples look older); an ancient one is a unit error or a broken clock."""

    now: float
    max_age_s: float
    max_future_s: float

    def check(self, t: float) -> str | None:
        """Why ``t`` is outside the window (None when inside)."""
        if t > self.now + self.max_future_s:
            return (f"{t:.3f} is {t - self.now:.0f} s in the future of the collector's clock"
                    f" (at most {self.max_future_s:g} s allowed: check the agent's clock)")
        if t < self.now - self.max_age_s:
            return (f"{t:.3f} is {self.now - t:.0f} s older than the collector's clock"
                    f" (at most {self.max_age_s:g} s allowed)")
        return None


@dataclasses.dataclass(frozen=True)
class CheckedBatch:
    """A batch fit to store: ``body`` is the request body, or the batch re-encoded without
    the ``refused`` records (what the staging log keeps must decode)."""

    batch: AgentBatch
    body: bytes
    refused: tuple[Refusal, ...] = ()


_PATH = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _value_at(raw: bytes, path: str) -> Any:
    """The value at msgspec error path ``path`` (``$.nvlink[2].replay``) of a raw record."""
    try:
        value: Any = msgspec.msgpack.decode(raw)
    except DECODE_ERRORS:
        return None
    for key, index in _PATH.findall(path[1:]):
        try:
            value = value[int(index)] if index else value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _refusal(exc: Exception, raw: bytes, record: str, i: int) -> Refusal:
    """Explain why record ``i`` of list ``record`` did not decode."""
    text = decode_error_message(exc, record[:-1]).partition(": ")[2]
    what, sep, where = text.rpartition(" - at `")
    path = where.rstrip("`") if sep else "$"
    what = what if sep else text
    field = f"$.{record}[{i}]{path[1:]}"
    value = _value_at(raw, path) if sep else None
    if isinstance(value, float) and not math.isfinite(value):
        return Refusal(record, field, "non_finite", f"{field}: {value} is not a finite number")
    if field.endswith("time") and isinstance(value, int | float):
        return Refusal(record, field, "time",
                       f"{field}: {value!r} is not Unix seconds before 2100 ({what})")
    reason = "range" if "<=" in what or ">=" in what else "type"
    shown = f" (got {value!r:.60})" if value is not None and reason == "range" else ""
    return Refusal(record, field, reason, f"{field}: {what}{shown}")


def _check_lengths(batch: Any, max_items: int) -> None:
    for name in _RECORDS:
        n = len(getattr(batch, name))
        if n > max_items:
            raise IngestError(413, "limits",
                              f"$.{name}: {n} items, more than the limit of {max_items}")


Origin = dict[str, list[int]]
"""Per record list, the index in the request of each record decoded (some were left out)."""


def _at(origin: Origin | None, name: str, i: int) -> int:
    """Index in the request of record ``i`` of the decoded list ``name``."""
    return origin[name][i] if origin else i


def _decode_by_record(body: bytes, max_items: int
                      ) -> tuple[AgentBatch, list[Refusal], Origin]:
    """Decode the batch's own fields, then each record alone, leaving out bad records."""
    try:
        envelope = _envelope_decoder.decode(body)
    except DECODE_ERRORS as exc:
        raise IngestError(400, "decode", decode_error_message(exc, "AgentBatch")) from None
    _check_lengths(envelope, max_items)
    refused: list[Refusal] = []
    origin: Origin = {}
    fields: dict[str, Any] = {}
    for name in envelope.__struct_fields__:
        if name not in _RECORDS:
            fields[name] = getattr(envelope, name)
            continue
        kept = fields[name] = []
        where = origin[name] = []
        decoder = _record_decoders[name]
        for i, raw in enumerate(getattr(envelope, name)):
            try:
                kept.append(decoder.decode(raw))
                where.append(i)
            except DECODE_ERRORS as exc:
                refused.append(_refusal(exc, raw, name, i))
    return AgentBatch(**fields), refused, origin


def _outside_window(batch: AgentBatch, window: TimeWindow, origin: Origin | None
                    ) -> list[tuple[int, Refusal]]:
    """Records whose times lie outside ``window``: (index in ``batch``, refusal naming the
    index in the request). Rank summaries: future times only (a last checkpoint may be old)."""
    out: list[tuple[int, Refusal]] = []

    def refuse(name: str, i: int, key: str, why: str) -> None:
        field = f"$.{name}[{_at(origin, name, i)}].{key}"
        out.append((i, Refusal(name, field, "time", f"{field}: {why}")))

    lo, hi = window.now - window.max_age_s, window.now + window.max_future_s
    for name in ("samples", "xids", "findings", "checkpoints"):
        items = getattr(batch, name)
        times = [item.time for item in items]
        if not times or (lo <= min(times) and max(times) <= hi):  # the usual case, cheap
            continue
        for i, item in enumerate(items):
            why = window.check(item.time)
            if why is not None:
                refuse(name, i, "time", why)
    future = dataclasses.replace(window, max_age_s=math.inf)
    for i, rank in enumerate(batch.ranks):
        for key in ("last_step_time", "last_beat"):
            t = getattr(rank, key)
            why = None if t is None else future.check(t)
            if why is not None:
                refuse("ranks", i, key, why)
                break
    return out


def _without(batch: AgentBatch, drops: Sequence[tuple[int, Refusal]]) -> AgentBatch:
    """``batch`` without the records at ``drops`` (index in ``batch``, refusal)."""
    gone: dict[str, set[int]] = collections.defaultdict(set)
    for i, r in drops:
        gone[r.record].add(i)
    return msgspec.structs.replace(batch, **{
        name: [x for i, x in enumerate(getattr(batch, name)) if i not in drop]
        for name, drop in gone.items()})


def check_batch(body: bytes, *, node: str, max_items: int,
                window: TimeWindow | None = None) -> CheckedBatch:
    """Decode ``body`` as an :class:`AgentBatch` sent by ``node``'s agent and check limits.

    Bad records are left out (see the module docstring); records outside ``window`` too.
    Raises :class:`IngestError` (400 bad batch, 403 another node's batch, 413 a list
    longer than ``max_items``).
    """
    refused: list[Refusal] = []
    origin: Origin | None = None
    try:
        batch = _batch_decoder.decode(body)
    except msgspec.ValidationError:  # find the bad records (rare: the fast path is above)
        batch, refused, origin = _decode_by_record(body, max_items)
    except DECODE_ERRORS as exc:
        raise IngestError(400, "decode", decode_error_message(exc, "AgentBatch")) from None
    _check_lengths(batch, max_items)
    if batch.node != node:
        raise IngestError(403, "node_mismatch",
                          f"$.node: token is for node {node!r}, batch says {batch.node!r}")
    for name in ("samples", "xids", "ranks"):
        for i, item in enumerate(getattr(batch, name)):
            if item.node != node:
                raise IngestError(403, "node_mismatch",
                                  f"$.{name}[{_at(origin, name, i)}].node: {item.node!r} is"
                                  f" not this agent's node {node!r}")
    # An agent speaks for its own node only: a finding about another node's GPU would let
    # one compromised agent order checkpoints or drains elsewhere.
    for i, f in enumerate(batch.findings):
        if f.subject.node not in ("", node):
            raise IngestError(403, "node_mismatch",
                              f"$.findings[{_at(origin, 'findings', i)}].subject.node:"
                              f" {f.subject.node!r} is not this agent's node {node!r}")
    if window is not None:
        late = _outside_window(batch, window, origin)
        if late:
            batch = _without(batch, late)
            refused.extend(r for _i, r in late)
    if not refused:
        return CheckedBatch(batch, body)
    return CheckedBatch(batch, encode(batch), tuple(refused))


def count_rejection(metrics: CollectorMetrics, exc: IngestError) -> None:
    """Count a batch refused whole (by reason)."""
    metrics.rejected.labels(exc.reason).inc()
    metrics.batches.labels("rejected").inc()


def count_refusals(metrics: CollectorMetrics, checked: CheckedBatch) -> None:
    """Count and log the records left out of a batch."""
    if not checked.refused:
        return
    for r in checked.refused:
        metrics.refused.labels(r.record, r.reason).inc()
    b = checked.batch
    log.warning("node %s batch %s/%s: %d record(s) refused: %s", b.node, b.agent_id, b.seq,
                len(checked.refused), "; ".join(r.message for r in checked.refused[:5]))
