"""Encoding and decoding: msgpack and JSON, with :class:`~forewarn.wire.WireError` naming
the bad field."""

from __future__ import annotations

from typing import Any, Final, TypeVar

import msgspec

from .base import WireError
from .training import AgentMessage, CheckpointOrder, HookMessage

T = TypeVar("T")

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_hook_decoder: msgspec.msgpack.Decoder[HookMessage] = msgspec.msgpack.Decoder(HookMessage)
_order_decoder = msgspec.msgpack.Decoder(CheckpointOrder)
_agent_decoder: msgspec.msgpack.Decoder[AgentMessage] = msgspec.msgpack.Decoder(AgentMessage)


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


def decode_hook_message(data: bytes) -> HookMessage:
    """Decode one hook datagram."""
    try:
        return _hook_decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise _wrap(exc, "hook message") from None


def decode_agent_message(data: bytes) -> AgentMessage:
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
