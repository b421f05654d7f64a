"""The wire records: round trips, versioning, and errors that name the field."""

from __future__ import annotations

import math

import msgspec
import pytest

from forewarn import wire


def _step(**kw: object) -> wire.StepRecord:
    base: dict[str, object] = dict(job="j", rank=1, pid=42, host="h", step=7, time=1.0)
    base.update(kw)
    return wire.StepRecord(**base)  # type: ignore[arg-type]


def test_hook_messages_round_trip_and_keep_nan() -> None:
    rec = _step(loss=float("nan"), grad_norm=float("inf"), extras={"lr": 0.1})
    out = wire.decode_hook_message(wire.encode(rec))
    assert isinstance(out, wire.StepRecord)
    assert math.isnan(out.loss or 0.0) and out.grad_norm == math.inf
    assert out.extras == {"lr": 0.1}
    beat = wire.Beat(job="j", rank=0, pid=1, host="h", time=2.0, reply_to="/tmp/x.sock")
    assert wire.decode_hook_message(wire.encode(beat)) == beat
    rep = wire.CheckpointReport(job="j", rank=0, step=5, phase="done", time=3.0, seconds=1.5)
    assert wire.decode_hook_message(wire.encode(rep)) == rep


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"step": "x"}, "$.step"),
        ({"step": -1}, "$.step"),
        ({"rank": None}, "$.rank"),
        ({"v": 99}, "$.v"),
        ({"job": ""}, "$.job"),
    ],
)
def test_bad_fields_are_named(patch: dict[str, object], field: str) -> None:
    raw = msgspec.to_builtins(_step())
    raw["type"] = "step"
    raw.update(patch)
    with pytest.raises(wire.WireError) as err:
        wire.decode_hook_message(msgspec.msgpack.encode(raw))
    assert field in str(err.value)


def test_unknown_message_type_and_garbage_are_wire_errors() -> None:
    with pytest.raises(wire.WireError, match="type"):
        wire.decode_hook_message(msgspec.msgpack.encode({"type": "nope"}))
    with pytest.raises(wire.WireError):
        wire.decode_hook_message(b"\xc1\xff garbage")


def test_batch_round_trips_json_and_msgpack() -> None:
    sample = wire.GpuSample(
        node="n1", gpu=0, time=1.0, source="sim", simulated=True, temperature_c=61.0,
        nvlink=(wire.NvlinkCounters(link=0, crc_flit=3),), unsupported=("memory_temperature_c",),
    )
    finding = wire.Finding(
        check="xid",
        health=wire.Health.UNHEALTHY,
        subject=wire.Subject(kind="gpu", node="n1", gpu=0),
        reason="XID 79: GPU has fallen off the bus", action=wire.SuggestedAction.DRAIN, time=1.0,
        evidence={"code": 79},
    )
    batch = wire.AgentBatch(node="n1", agent_id="a", seq=3, created=1.0, samples=[sample],
                            findings=[finding])
    assert wire.decode(wire.encode(batch), wire.AgentBatch) == batch
    assert wire.decode_json(wire.encode_json(batch), wire.AgentBatch) == batch
    assert finding.subject.key() == "gpu:n1/0"


def test_order_decoding() -> None:
    order = wire.CheckpointOrder(request_id="r1", job="j", step=100, reason="xid 79", issued=5.0)
    assert wire.decode_order(wire.encode(order)) == order
    with pytest.raises(wire.WireError, match="request_id"):
        wire.decode_order(wire.encode({"request_id": "", "job": "j", "step": 1, "issued": 0.0}))
