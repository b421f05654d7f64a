"""Per-step cost of ``Monitor.step()`` against TensorBoard's ``SummaryWriter.add_scalar``.

Same run, same two scalars (loss, grad norm, Python floats), each call timed with
``perf_counter_ns``. Three hook cases:

* ``agent``: a receiving socket in a separate process drains the datagrams, as the agent
  would, so sends succeed (a full queue would count as dropped; the count is printed);
* ``no agent``: nothing listens at the socket path: reports are counted as dropped;
* the peer: ``SummaryWriter.add_scalar("loss") + add_scalar("grad_norm")`` to a temp dir.

Usage: ``python bench/hook_step.py [--calls 200000] [--peer-calls 50000]``.
Goal (issues 3 and 15): median under 2 µs and at least 50x cheaper than the peer.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from forewarn.hook import Monitor

_DRAIN = """
import socket, sys
r = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
r.bind(sys.argv[1])
print("ready", flush=True)
n = 0
while True:
    b = r.recv(65536)
    if b == b"quit":
        break
    n += 1
print(n, flush=True)
"""


def _time_calls(fn: Callable[[int], None], calls: int, pace_s: float = 0.0) -> list[int]:
    clock = time.perf_counter_ns
    out = [0] * calls
    gc.disable()
    try:
        for i in range(calls):
            t0 = clock()
            fn(i)
            out[i] = clock() - t0
            if pace_s:
                time.sleep(pace_s)  # untimed: lets the receiver keep up, like a real step
    finally:
        gc.enable()
    return out


def _summary(ns: list[int]) -> tuple[float, float, float]:
    s = sorted(ns)
    return s[len(s) // 2] / 1e3, s[int(len(s) * 0.99)] / 1e3, statistics.fmean(s) / 1e3


CPU_PER_CALL: dict[str, float] = {}


def bench_monitor(
    socket_path: str, calls: int, pace_s: float = 0.0, label: str = ""
) -> tuple[list[int], int]:
    """Time each ``step()``; also record process CPU time per call (main thread plus the
    hook's background sender, which packs the records and does the ``send`` syscalls)."""
    mon = Monitor(job="bench", rank=0, world_size=1, socket_path=socket_path,
                  handle_sigterm=False)
    step = mon.step
    loss, gn = 2.5, 0.75

    def one(i: int) -> None:
        step(i, loss=loss, grad_norm=gn)

    _time_calls(one, 1000)  # warm-up
    cpu0 = time.process_time()
    ns = _time_calls(one, calls, pace_s)
    mon.close()  # flushes the queue: its sends are in the CPU figure
    cpu = time.process_time() - cpu0
    if label:
        # the timing loop itself (perf_counter_ns, list store, sleep) is in cpu too
        CPU_PER_CALL[label] = cpu / calls * 1e6
    return ns, mon.dropped


def bench_tensorboard(calls: int) -> list[int]:
    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as d:
        w = SummaryWriter(d)
        add = w.add_scalar
        loss, gn = 2.5, 0.75

        def one(i: int) -> None:
            add("loss", loss, i)
            add("grad_norm", gn, i)

        _time_calls(one, 200)
        ns = _time_calls(one, calls)
        w.close()
    return ns


def _with_agent(path: str, calls: int, pace_s: float) -> tuple[list[int], int, int]:
    """Run the hook against a draining receiver process; returns (ns, dropped, received)."""
    drain = subprocess.Popen([sys.executable, "-c", _DRAIN, path], stdout=subprocess.PIPE,
                             text=True)
    assert drain.stdout is not None
    drain.stdout.readline()
    try:
        ns, dropped = bench_monitor(path, calls, pace_s, label=f"agent-{pace_s}")
    finally:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"quit", path)
        received = int(drain.stdout.readline())
        drain.wait()
        os.unlink(path)
    return ns, dropped, received


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--paced-calls", type=int, default=20_000)
    ap.add_argument("--pace-us", type=float, default=50.0)
    ap.add_argument("--peer-calls", type=int, default=50_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "agent.sock")
        paced = _with_agent(path, args.paced_calls, args.pace_us / 1e6)
        flood = _with_agent(path, args.calls, 0.0)
        none_ns, none_dropped = bench_monitor(os.path.join(d, "absent.sock"), args.calls,
                                              label="none")
        bench_monitor(os.path.join(d, "absent.sock"), args.paced_calls, args.pace_us / 1e6,
                      label=f"none-{args.pace_us / 1e6}")
    tb_ns = bench_tensorboard(args.peer_calls)
    tb_med = _summary(tb_ns)[0]
    rows = [
        (f"step(), agent, paced {args.pace_us:g} µs", paced[0],
         f"{args.paced_calls} calls, received {paced[2]}, dropped {paced[1]}"),
        ("step(), agent, back-to-back", flood[0],
         f"{args.calls} calls, received {flood[2]}, dropped {flood[1]}"),
        ("step(), no agent", none_ns, f"{args.calls} calls, dropped {none_dropped}"),
        ("TensorBoard add_scalar x2", tb_ns, f"{args.peer_calls} calls"),
    ]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'case':34} {'median µs':>10} {'p99 µs':>9} {'mean µs':>9} {'peer/this':>10}  note")
    for name, ns, note in rows:
        med, p99, mean = _summary(ns)
        print(f"{name:34} {med:10.2f} {p99:9.2f} {mean:9.2f} {tb_med / med:9.1f}x  {note}")
    pace = args.pace_us / 1e6
    sender = CPU_PER_CALL[f"agent-{pace}"] - CPU_PER_CALL[f"none-{pace}"]
    print(f"process CPU per paced step, agent minus no agent (the background sender's "
          f"packing and send syscalls, amortized): {sender:.2f} µs")


if __name__ == "__main__":
    main()
