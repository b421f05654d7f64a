"""Hand-rolled msgpack for the common :class:`~forewarn.wire.StepRecord`.

``monitor.step()`` must cost microseconds, so the record is not built as a Struct and
encoded field by field on every call. Everything constant for this rank (tag, version,
job, rank, pid, host and every map key) is encoded once with msgspec; one precompiled
:class:`struct.Struct` then packs the five per-step values between those constant
chunks. The output is a msgpack map that :func:`forewarn.wire.decode_hook_message`
decodes to exactly the record msgspec would have built (tests compare them).

The fast form covers ``step`` (uint64), ``time``, ``step_seconds``, ``loss`` and
``grad_norm`` (float64) with no extras. Anything else (``None`` values, extras) goes
through :func:`forewarn.wire.encode` of a real Struct.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import msgspec

from forewarn.wire import StepRecord

from ._identity import RankIdentity

__all__ = ["StepPacker", "build_step_packer"]

StepPacker = Callable[[int, float, float, float, float], bytes]
"""``pack(step, time, step_seconds, loss, grad_norm) -> datagram``."""

_VARIABLE = {"step": "Q", "time": "d", "step_seconds": "d", "loss": "d", "grad_norm": "d"}
_MARKER = {"Q": b"\xcf", "d": b"\xcb"}  # msgpack uint64 / float64 type bytes


def _map_header(n: int) -> bytes:
    if n <= 15:
        return bytes([0x80 | n])
    return b"\xde" + struct.pack(">H", n)


def build_step_packer(ident: RankIdentity) -> StepPacker:
    """Return a function that packs one step of this rank into a datagram."""
    template = StepRecord(
        job=ident.job, rank=ident.rank, local_rank=ident.local_rank,
        world_size=ident.world_size, pid=ident.pid, host=ident.host,
        step=0, time=0.0, step_seconds=0.0, loss=0.0, grad_norm=0.0,
    )
    enc = msgspec.msgpack.encode
    config = StepRecord.__struct_config__
    names = StepRecord.__struct_fields__
    chunk = _map_header(len(names) + 1) + enc(config.tag_field) + enc(config.tag)
    fmt = ">"
    consts: list[bytes] = []
    order: list[str] = []
    for name in names:
        chunk += enc(name)
        code = _VARIABLE.get(name)
        if code is None:
            chunk += enc(getattr(template, name))
            continue
        chunk += _MARKER[code]
        order.append(name)
        consts.append(chunk)
        fmt += f"{len(chunk)}s{code}"
        chunk = b""
    if chunk:
        consts.append(chunk)
        fmt += f"{len(chunk)}s"
    if order != list(_VARIABLE):
        raise RuntimeError(f"StepRecord layout changed: variable fields in order {order}")
    pack = struct.Struct(fmt).pack
    c = consts + [b""] * (7 - len(consts))
    c0, c1, c2, c3, c4, c5 = c[0], c[1], c[2], c[3], c[4], c[5]
    if chunk:

        def packer(step: int, t: float, ss: float, loss: float, gn: float) -> bytes:
            return pack(c0, step, c1, t, c2, ss, c3, loss, c4, gn, c5)

    else:  # pragma: no cover - extras is the last field today

        def packer(step: int, t: float, ss: float, loss: float, gn: float) -> bytes:
            return pack(c0, step, c1, t, c2, ss, c3, loss, c4, gn)

    return packer
