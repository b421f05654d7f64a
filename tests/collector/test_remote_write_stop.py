"""Stopping remote write with requests in flight (issue 16): :meth:`RemoteWriter.stop`
acknowledges nothing that was not written. A :meth:`RemoteWriter.written` future made
before the stop is done only when every sample before it is in the store; samples a
failed or abandoned request carried stay unacknowledged, so the bus hands their batches
out again and agents resend. No exception escapes a sender thread. Against a real HTTP
server on loopback that holds each request until the test lets it answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.remote_write import RemoteWriter
from forewarn.wire import GpuSample

from support.held_store import HeldStore
from support.polling import wait_for


def one_gpu(t: float, n: int = 4) -> list[GpuSample]:
    """``n`` samples of one GPU (one series: they all go through one sender thread)."""
    return [GpuSample(node="n0", gpu=0, uuid="GPU-0", time=t + i, source="sim",
                      simulated=True, temperature_c=60.0) for i in range(n)]


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that escaped any thread while the test ran."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        errors.append(args.exc_value if args.exc_value is not None else RuntimeError())

    threading.excepthook = hook
    try:
        yield errors
    finally:
        threading.excepthook = previous


def stopping(writer: RemoteWriter) -> bool:
    """Whether ``stop`` began: a new ``written`` future then fails at once."""
    return writer.written().exception(timeout=0) is not None


def test_a_request_that_fails_during_stop_acknowledges_nothing_after_it(
        thread_errors: list[BaseException]) -> None:
    store = HeldStore(answers=(503,))
    metrics = CollectorMetrics()
    writer = RemoteWriter(store.url, metrics, shards=1, batch_samples=4, backoff_s=0.05)
    writer.start()
    t0 = time.time() - 60
    try:
        writer.offer(one_gpu(t0))
        first = writer.written()  # the first request's samples
        writer.offer(one_gpu(t0 + 10))
        both = writer.written()
        wait_for(lambda: store.waiting() == 1, 10, "the first request held")
        stopper = threading.Thread(target=writer.stop, kwargs={"timeout_s": 10.0})
        stopper.start()
        wait_for(lambda: stopping(writer), 10, "stop to begin")
        store.release_one()  # 503 while stopping: its samples are not written
        # Let go of whatever else is sent while stop drains (before the fix: the second
        # request, answered 204), until stop returns.
        while stopper.is_alive():
            if store.waiting():
                store.release_one()
            stopper.join(0.05)
        for future in (first, both):
            with pytest.raises(RuntimeError, match="remote write stopped"):
                future.result(timeout=0)
        dropped = metrics.registry.get_sample_value(
            "forewarn_collector_remote_write_dropped_samples_total", {"reason": "shutdown"})
        written = metrics.registry.get_sample_value(
            "forewarn_collector_remote_write_samples_total") or 0.0
        assert (dropped, written) == (8.0, 0.0)
        assert thread_errors == []
    finally:
        store.close()


def test_stop_under_a_hung_request_returns_and_acknowledges_nothing(
        thread_errors: list[BaseException]) -> None:
    store = HeldStore()
    writer = RemoteWriter(store.url, CollectorMetrics(), shards=1, timeout_s=2.0)
    writer.start()
    try:
        writer.offer(one_gpu(time.time() - 60))
        pending = writer.written()
        wait_for(lambda: store.waiting() == 1, 10, "the request held")
        started = time.monotonic()
        writer.stop(timeout_s=0.3)
        assert time.monotonic() - started < 2.0  # not the request's own timeout
        with pytest.raises(RuntimeError, match="remote write stopped"):
            pending.result(timeout=0)
        store.release_one()  # the store answers at last, to a closed client
        wait_for(lambda: not any(t.name.startswith("forewarn-remote-write")
                                 for t in threading.enumerate()), 10,
                 "the sender thread to end")
        assert thread_errors == []
        with pytest.raises(RuntimeError):  # nothing is acknowledged after stop
            writer.written().result(timeout=0)
    finally:
        store.close()


def test_written_futures_before_stop_that_were_written_stay_done() -> None:
    """The other side: what the store took before the stop is acknowledged."""
    store = HeldStore()
    writer = RemoteWriter(store.url, CollectorMetrics(), shards=1, batch_samples=4)
    writer.start()
    try:
        writer.offer(one_gpu(time.time() - 60))
        done = writer.written()
        wait_for(lambda: store.waiting() == 1, 10, "the request held")
        store.release_one()
        assert done.result(timeout=10) is None
        writer.stop(timeout_s=1.0)
        assert done.exception(timeout=0) is None
    finally:
        store.close()
