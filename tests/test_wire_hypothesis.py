"""Property-based tests of the wire decoders: on any input they return a valid record or
raise :class:`WireError` naming the problem, never anything else."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forewarn.collector.ingest.validate import IngestError, check_batch
from forewarn.wire import (
    AgentBatch,
    Beat,
    CheckpointOrder,
    CheckpointReport,
    Command,
    CommandAck,
    Finding,
    GpuSample,
    Health,
    NvlinkCounters,
    RankSummary,
    StepRecord,
    Subject,
    SuggestedAction,
    WireError,
    XidEvent,
    decode,
    decode_hook_message,
    decode_json,
    decode_order,
    encode,
    encode_json,
)

from support.collector import TOKENS, Service, start_service, stop_service

RECORDS: list[type[Any]] = [AgentBatch, GpuSample, XidEvent, Finding, RankSummary,
                            CheckpointReport, CheckpointOrder, Command, CommandAck, StepRecord,
                            Beat]
FIELD_NAMES = sorted({f for r in RECORDS for f in r.__struct_fields__} | {"type", "link"})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=10)), inner,
                        max_size=8),
    ),
    max_leaves=30,
)
records = st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=14)

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def only_wire_error(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except WireError as exc:
        assert str(exc).startswith("invalid "), exc
        return None


@SETTINGS
@given(data=st.binary(max_size=512), kind=st.sampled_from(RECORDS))
def test_random_bytes_decode_or_raise_wire_error(data: bytes, kind: type[Any]) -> None:
    only_wire_error(decode, data, kind)
    only_wire_error(decode_json, data, kind)
    only_wire_error(decode_hook_message, data)
    only_wire_error(decode_order, data)


@SETTINGS
@given(record=records, kind=st.sampled_from(RECORDS), tag=st.sampled_from(
    ["step", "beat", "checkpoint", "other", None]))
def test_random_maps_decode_or_raise_wire_error(record: dict[str, Any], kind: type[Any],
                                                tag: str | None) -> None:
    if tag is not None:
        record = {**record, "type": tag}
    packed = msgspec.msgpack.encode(record)
    got = only_wire_error(decode, packed, kind)
    if got is not None:
        assert isinstance(got, kind)
    only_wire_error(decode_hook_message, packed)
    only_wire_error(decode_order, packed)
    try:
        text = msgspec.json.encode(record)
    except (TypeError, ValueError, OverflowError):
        return  # bytes or huge ints have no JSON form
    only_wire_error(decode_json, text, kind)


@SETTINGS
@given(data=st.binary(max_size=1024))
def test_ingest_check_refuses_random_bytes_with_a_4xx(data: bytes) -> None:
    try:
        check_batch(data, node="n", max_items=100)
    except IngestError as exc:
        assert 400 <= exc.status < 500 and str(exc)


names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
opt_count = st.none() | st.integers(0, 2**63 - 1)

samples = st.builds(
    GpuSample, node=names, gpu=st.integers(0, 64), time=st.floats(0, 4e9), source=st.just("sim"),
    temperature_c=st.none() | finite, power_w=st.none() | finite,
    ecc_corrected_volatile=opt_count, remap_pending=st.none() | st.booleans(),
    nvlink=st.lists(st.builds(NvlinkCounters, link=st.integers(0, 17), crc_flit=opt_count),
                    max_size=3).map(tuple),
    unsupported=st.lists(st.text(max_size=20), max_size=3).map(tuple),
)
findings = st.builds(
    Finding, check=names, health=st.sampled_from(list(Health)), reason=st.text(max_size=100),
    subject=st.builds(Subject, kind=st.sampled_from(["gpu", "node", "rank", "job"]),
                      node=st.text(max_size=20), gpu=st.none() | st.integers(0, 64)),
    action=st.sampled_from(list(SuggestedAction)), time=st.floats(0, 4e9),
    evidence=st.dictionaries(st.text(max_size=20), st.none() | st.booleans() | finite
                             | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
                             max_size=4),
    probability=st.none() | st.floats(0, 1),
)
batches = st.builds(
    AgentBatch, node=names, agent_id=names, seq=st.integers(0, 2**63 - 1),
    created=st.floats(0, 4e9), urgent=st.booleans(), samples=st.lists(samples, max_size=4),
    findings=st.lists(findings, max_size=3),
)


@SETTINGS
@given(batch=batches)
def test_valid_batches_round_trip(batch: AgentBatch) -> None:
    assert decode(encode(batch), AgentBatch) == batch
    back = decode_json(encode_json(batch), AgentBatch)
    assert back.seq == batch.seq and len(back.samples) == len(batch.samples)


@SETTINGS
@given(batch=batches, path=st.data(), junk=values)
def test_one_corrupted_field_is_refused_with_its_name_or_accepted(
        batch: AgentBatch, path: st.DataObject, junk: Any) -> None:
    raw: dict[str, Any] = msgspec.to_builtins(batch)
    key = path.draw(st.sampled_from(sorted(raw)))
    raw[key] = junk
    try:
        got = decode(msgspec.msgpack.encode(raw), AgentBatch)
    except WireError as exc:
        assert f"$.{key}" in str(exc) or "Expected" in str(exc) or "Invalid" in str(exc), exc
        return
    assert isinstance(got, AgentBatch)


@pytest.mark.parametrize("bad", [math.nan, -1.0, 2.0])
def test_probability_out_of_range_names_the_field(bad: float) -> None:
    data = msgspec.msgpack.encode({"check": "x", "health": "unhealthy", "reason": "",
                                   "subject": {"kind": "gpu"}, "time": 1.0,
                                   "probability": bad})
    with pytest.raises(WireError, match=r"\$\.probability"):
        decode(data, Finding)


# -- the whole ingest route over real HTTP --------------------------------------------

@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(tmp_path_factory.mktemp("ingest-hypothesis"),
                        sqlite_synchronous="NORMAL")
    yield svc
    stop_service(svc)


NOW = time.time()
live_samples = st.builds(
    GpuSample, node=st.just("node1"), gpu=st.integers(0, 7), time=st.floats(NOW - 60, NOW),
    source=st.just("sim"), temperature_c=st.none() | finite, power_w=st.none() | finite,
    ecc_corrected_volatile=opt_count,
    nvlink=st.lists(st.builds(NvlinkCounters, link=st.integers(0, 17), crc_flit=opt_count),
                    max_size=2).map(tuple),
)
live_batches = st.builds(
    AgentBatch, node=st.just("node1"), agent_id=st.just("agent-node1"),
    seq=st.integers(0, 2**40), created=st.just(NOW), urgent=st.booleans(),
    samples=st.lists(live_samples, min_size=1, max_size=4),
)


poisons = st.sampled_from([math.inf, -math.inf, math.nan, 2**63, 2**64 - 1, -1,
                           NOW * 1000, NOW + 86400 * 365, 1e300, "x" * 300, [[[[]]]]])
"""Values that once got through or crashed something: one is likely to be drawn."""


@st.composite
def hostile_bodies(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes, deep nesting, a valid batch with bytes flipped or cut, or one with
    a field of itself or of a sample replaced by junk."""
    kind = draw(st.sampled_from(["bytes", "nested", "flipped", "field", "field"]))
    if kind == "bytes":
        return draw(st.binary(max_size=2048))
    if kind == "nested":  # inside a key the decoder would skip: msgspec recurses there
        depth = draw(st.integers(500, 20_000))
        return b"\x81\xa5extra" + draw(st.sampled_from([b"\x91", b"\x81\xa1k"])) * depth
    batch = draw(live_batches)
    if kind == "flipped":
        body = bytearray(encode(batch))
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(body) - 1))
            body[i] = draw(st.integers(0, 255))
        return bytes(body[:draw(st.integers(1, len(body)))])
    raw: dict[str, Any] = msgspec.to_builtins(batch)
    target = raw if draw(st.booleans()) else raw["samples"][0]
    target[draw(st.sampled_from([*sorted(target), "extra"]))] = draw(poisons | values)
    return msgspec.msgpack.encode(raw)


HTTP_SETTINGS = settings(max_examples=200, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow])


@HTTP_SETTINGS
@given(body=hostile_bodies())
def test_any_body_gets_a_2xx_or_a_4xx_with_a_reason_and_other_agents_keep_flowing(
        live: Service, body: bytes) -> None:
    r = live.client.post("/api/v1/ingest", content=body, headers={
        "content-type": "application/msgpack", "authorization": f"Bearer {TOKENS['node1']}"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"], r.text
    else:
        assert r.json()["result"] in ("stored", "duplicate"), r.text
    before = live.store.scalar("SELECT COUNT(*) FROM batches WHERE node = 'node2'")
    live.push("node2", samples=[GpuSample(node="node2", gpu=0, time=time.time(),
                                          source="sim", temperature_c=50.0)])
    assert live.store.scalar("SELECT COUNT(*) FROM batches WHERE node = 'node2'") == before + 1
    app: Any = live.server.server.config.app
    app.state.ctx.telemetry.flush()  # nothing accepted can wedge the flush
