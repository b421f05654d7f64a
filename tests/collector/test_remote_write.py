"""The collector's GPU series to a real VictoriaMetrics by Prometheus remote write: every
accepted sample once (a batch sent again is not written again), the dashboards' panel
queries answer against it unchanged, an unreachable store is retried with backoff and a
full queue drops new samples, counted."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.remote_write import RemoteWriter, encode_write_request
from forewarn.demo.servers import VictoriaMetrics
from forewarn.wire import AgentBatch, GpuSample, encode

from support.collector import TOKENS, start_service, stop_service
from support.metrics import value
from support.paths import REPO
from support.polling import free_port, wait_for

DASHBOARDS = REPO / "dashboards"


@pytest.fixture
def vm(require_binary: object) -> Iterator[VictoriaMetrics]:
    server = VictoriaMetrics(require_binary("victoria-metrics"))  # type: ignore[operator]
    yield server
    server.stop()


def gpu_samples(node: str, t: float) -> list[GpuSample]:
    return [GpuSample(node=node, gpu=g, uuid=f"GPU-{node}-{g}", time=t, source="sim",
                      simulated=True, temperature_c=60.0 + g, power_w=300.0 + t % 7,
                      gpu_util_pct=90.0, sm_clock_mhz=1980.0, pstate=0)
            for g in range(4)]


def test_every_accepted_sample_reaches_victoriametrics_once(
        tmp_path: Path, vm: VictoriaMetrics) -> None:
    svc = start_service(tmp_path, remote_write_url=vm.write_url,
                        remote_write_labels={"cluster": "c1"})
    try:
        t0 = time.time() - 30
        batches = [AgentBatch(node="node1", agent_id="agent-node1", seq=i, created=t0 + i,
                              samples=gpu_samples("node1", t0 + i)) for i in range(5)]
        headers = {"content-type": "application/msgpack",
                   "authorization": f"Bearer {TOKENS['node1']}"}
        for b in [*batches, batches[2]]:  # the third batch again: a retry after a lost answer
            r = svc.client.post("/api/v1/ingest", content=encode(b), headers=headers)
            assert r.status_code == 200, r.text
        exported = wait_for(lambda: len(got := vm.export(
            'forewarn_gpu_temperature_celsius{node="node1"}')) == 4 and all(
            len(s["values"]) == 5 for s in got) and got, what="20 temperature samples in VM")
        for series in exported:
            assert series["metric"]["cluster"] == "c1"
            assert series["timestamps"] == [round((t0 + i) * 1000) for i in range(5)]
            assert series["values"] == [60.0 + int(series["metric"]["gpu"])] * 5
        # the utilization is a ratio, the clock in hertz: the exporter's names and scales
        util = vm.query('forewarn_gpu_utilization_ratio{node="node1", gpu="0"}')
        assert float(util[0]["value"][1]) == pytest.approx(0.9)
    finally:
        stop_service(svc)


def test_dashboard_panel_queries_answer_against_victoriametrics(
        tmp_path: Path, vm: VictoriaMetrics) -> None:
    svc = start_service(tmp_path, remote_write_url=vm.write_url,
                        remote_write_labels={"cluster": "c1"})
    try:
        svc.push("node1", samples=gpu_samples("node1", time.time() - 5))
        wait_for(lambda: vm.query("forewarn_gpu_info"), what="series in VM")
    finally:
        stop_service(svc)
    panels = json.loads((DASHBOARDS / "node.json").read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", ())]
    wanted = ["forewarn_gpu_temperature_celsius", "forewarn_gpu_power_watts",
              "forewarn_gpu_utilization_ratio", "forewarn_gpu_sm_clock_hertz",
              "forewarn_gpu_performance_state"]
    checked = 0
    for expr in exprs:
        if not any(expr.startswith(name + "{") for name in wanted):
            continue
        query = (expr.replace("$cluster", "c1").replace("$node", "node1")
                 .replace("$gpu", ".*").replace("$__rate_interval", "1m"))
        result = vm.query(query)
        assert len(result) == 4, (query, result)  # one series per GPU, as from Prometheus
        checked += 1
    assert checked == len(wanted)


def test_unreachable_store_is_retried_and_a_full_queue_drops_counted() -> None:
    metrics = CollectorMetrics()
    url = f"http://127.0.0.1:{free_port()}/api/v1/write"  # nothing listens
    # One shard: one request in flight, so the arithmetic below is exact.
    writer = RemoteWriter(url, metrics, queue_samples=6, batch_samples=2, shards=1,
                          backoff_s=0.05, backoff_max_s=0.2, timeout_s=1.0)
    writer.start()
    try:
        writer.offer(gpu_samples("n", time.time()))  # 4 fit
        writer.offer(gpu_samples("n", time.time()))  # 2 of these fit (2 went to the sender)
        wait_for(lambda: value(metrics.registry,
                               "forewarn_collector_remote_write_retries_total") >= 3,
                 what="retries")
        assert writer.last_error.startswith("ConnectError")
        dropped = value(metrics.registry, "forewarn_collector_remote_write_dropped_samples_total",
                         reason="queue_full")
        assert dropped == 8 - writer.queued - 2  # what neither the queue nor the request holds
        assert value(metrics.registry, "forewarn_collector_remote_write_samples_total") == 0
        pending = writer.written()
    finally:
        writer.stop(timeout_s=0.5)
    # stopped before the store took them: whoever waits (the bus) must not acknowledge
    with pytest.raises(RuntimeError, match="stopped"):
        pending.result(timeout=0)


class Unavailable(http.server.BaseHTTPRequestHandler):
    """A store that answers every remote write 503 (retry later), counting them."""

    posts = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_stop_during_a_retry_ends_the_sender_without_touching_the_closed_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() while the sender waits out a backoff wakes it: the thread is gone when stop()
    returns, so no request goes out on the client stop() closed and no error is raised
    in the thread."""
    class Store(Unavailable):
        posts = 0  # this test's own count

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    metrics = CollectorMetrics()
    writer = RemoteWriter(f"http://127.0.0.1:{server.server_address[1]}/api/v1/write",
                          metrics, backoff_s=5.0)
    try:
        writer.start()
        writer.offer(gpu_samples("n", time.time()))
        wait_for(lambda: value(metrics.registry, "forewarn_collector_remote_write_retries_total"),
                 what="the first request refused, the sender in its backoff")
        writer.stop(timeout_s=2.0)
        alive = [t for t in writer._threads if t.is_alive()]
        posts = Store.posts
        for t in alive:
            t.join(15)  # where it outlived stop(): let it wake and act
        assert errors == []
        assert Store.posts == posts  # nothing sent after stop() returned
        assert alive == []
        assert value(metrics.registry, "forewarn_collector_remote_write_dropped_samples_total",
                      reason="shutdown") == 4
    finally:
        server.shutdown()
        server.server_close()


def test_written_is_done_once_the_store_took_every_sample_offered(vm: VictoriaMetrics
                                                                   ) -> None:
    metrics = CollectorMetrics()
    writer = RemoteWriter(vm.write_url, metrics, batch_samples=3)
    try:
        assert writer.written().done()  # nothing offered
        writer.offer(gpu_samples("n", time.time() - 2))
        first = writer.written()
        writer.offer(gpu_samples("n", time.time() - 1))
        both = writer.written()
        assert not first.done()  # the sender has not started: nothing sent
        writer.start()
        both.result(timeout=20)
        assert first.done()
        assert value(metrics.registry, "forewarn_collector_remote_write_samples_total") == 8
    finally:
        writer.stop()


def test_write_request_encoding_is_the_prometheus_protobuf() -> None:
    # WriteRequest{TimeSeries{Label{__name__, up}, Sample{1.0, 1000}}}, byte by byte
    body = encode_write_request([((("__name__", "up"),), [(1000, 1.0)])])
    label = b"\x0a\x08__name__" + b"\x12\x02up"
    sample = b"\x09" + bytes.fromhex("000000000000f03f") + b"\x10\xe8\x07"
    series = b"\x0a" + bytes([len(label)]) + label + b"\x12" + bytes([len(sample)]) + sample
    assert body == b"\x0a" + bytes([len(series)]) + series


def test_a_failing_stores_url_is_logged_without_its_token(
        caplog: pytest.LogCaptureFixture) -> None:
    """A remote-write URL may carry a token (in its query, or as user:password@): the
    retries' warnings and httpx's request lines name the store by scheme, host and port."""
    class Store(Unavailable):
        posts = 0

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    caplog.set_level("DEBUG")
    metrics = CollectorMetrics()
    port = server.server_address[1]
    writer = RemoteWriter(f"http://user:Pw5ecret@127.0.0.1:{port}/api/v1/write?token=T0kenXyz",
                          metrics, backoff_s=0.01)
    try:
        writer.start()
        writer.offer(gpu_samples("n", time.time()))
        wait_for(lambda: Store.posts >= 2, what="two requests refused 503")
    finally:
        writer.stop(timeout_s=2.0)
        server.shutdown()
        server.server_close()
    assert f"remote write http://127.0.0.1:{port}/… failed" in caplog.text
    assert "T0kenXyz" not in caplog.text and "Pw5ecret" not in caplog.text
