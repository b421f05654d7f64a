"""The one harness that starts a real forewarn stack on loopback for tests.

Building blocks, used by every test that starts the product's processes:

* :class:`Processes`: named real processes of one test, each logging to
  ``<tmp>/<name>.log``, polled with a check that none died (naming it, with its log), and
  stopped together in reverse start order;
* :func:`start_collector` (``forewarn collector run`` from a written config, waiting for
  ``/healthz``), :func:`enroll` (a node's token), :func:`start_agent` (``forewarn agent
  --source sim`` on a scenario, waiting for ``/healthz`` and its socket),
  :func:`start_prometheus` (Debian's Prometheus scraping given targets);
* :class:`Stack`: all of them at once -- a collector, one simulated node whose scenario
  plays ECC, thermal, PCIe (ending in XID 79), row-remap and NVLink faults within seconds,
  a small training job of rank processes using :class:`forewarn.hook.Monitor` (one may
  report a NaN loss, one may hang) and, when asked, Prometheus with
  ``dashboards/rules/forewarn.rules.yml`` loaded (tests/dashboards/test_dashboards_prometheus.py,
  tests/collector/test_status_page_browser.py).

The daemons' command lines and config files are the product's
(:mod:`forewarn.spawn.commands`, shared with the chaos lab and the demo; tests that run
an agent themselves use its ``agent_command``). The in-process collector (no subprocess)
is :mod:`support.collector`.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from forewarn.collector.http.auth import enroll
from forewarn.spawn.commands import agent_command, collector_command, write_config
from forewarn.spawn.procs import Procs, log_tail

from support.polling import START_TIMEOUT_S, free_port, wait_for

__all__ = ["CLUSTER", "DASHBOARDS", "JOB", "NODE", "RULES", "Processes", "PromError", "Stack",
           "http_get", "running_stack", "start_agent", "start_collector", "start_prometheus"]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "rules" / "forewarn.rules.yml"

CLUSTER = "itest"
NODE = "dash-node"
JOB = "dash-job"

SCENARIO = """
name = "dashboards"
description = '''Every hardware signal the dashboards show, early: ECC storm ending in a
DBE (XID 92, 48), thermal runaway that stays hot, PCIe replays ending off the bus (XID 79),
row remaps ending in a remap failure (XID 63, 64), NVLink CRC errors ending in XID 74.'''
gpus = 6
seed = 3

[[faults]]
gpu = 1
kind = "ecc_storm"
start_s = 0
duration_s = 16

[[faults]]
gpu = 2
kind = "thermal_runaway"
start_s = 0
duration_s = 16
recover = false

[[faults]]
gpu = 3
kind = "pcie_replay"
start_s = 0
duration_s = 20

[[faults]]
gpu = 4
kind = "remap_growth"
start_s = 0
duration_s = 16

[[faults]]
gpu = 5
kind = "nvlink_crc"
start_s = 0
duration_s = 16
"""

RANK = r'''
"""One rank of a toy job: reports steps to the agent, saves when ordered."""
import sys, time
from pathlib import Path
from forewarn.hook import Monitor

job, rank, local, world, sock, out = sys.argv[1:7]
nan_at, hang_at = int(sys.argv[7]), int(sys.argv[8])
rank, local, world, out = int(rank), int(local), int(world), Path(out)
m = Monitor(job=job, rank=rank, world_size=world, local_rank=local, socket_path=sock,
            beat_interval_s=0.2, handle_sigterm=False)
step = 0
saved = False
while True:
    time.sleep(0.05)
    step += 1
    if step == hang_at:
        time.sleep(3600)  # hung: beats go on, steps stop
    # The NaN comes after the job's first ordered save: a NaN holds the job's saves from then
    # on (no poisoned state is saved), and the tests want both the save and the NaN.
    loss = float("nan") if saved and 0 <= nan_at <= step else 2.0 / step
    m.step(step, loss=loss, grad_norm=0.5 + 0.01 * rank)
    if m.should_checkpoint(step):
        t0 = time.monotonic()
        (out / f"rank{rank}-step{step}.ckpt").write_bytes(b"x" * 4096)
        m.checkpoint_done(step, time.monotonic() - t0 + 0.01, 4096, str(out))
        saved = True
'''


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


class Processes:
    """Named real processes of one test, logging to ``<tmp>/<name>.log``: the product's
    :class:`~forewarn.spawn.procs.Procs` (each in a process group of its own), with what
    tests add. Children get the test's environment without ``FOREWARN_*`` settings and
    ``NOTIFY_SOCKET`` (a developer's or CI's own must not leak in), unbuffered; a wait
    fails as soon as any of them died; :meth:`close` stops them the last started first."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.group = Procs()

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        """The process of each name (the newest of a name started again)."""
        return self.group.procs

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("FOREWARN_") and k != "NOTIFY_SOCKET"}
        return self.group.spawn(name, args, self.tmp / f"{name}.log",
                                {**base, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd)

    def log_tail(self, name: str, n: int = 3000) -> str:
        return log_tail(self.tmp / f"{name}.log", n)

    def wait_for(self, what: str, probe: Callable[[], Any], timeout: float = 60,
                 every: float = 0.25) -> Any:
        """Poll ``probe`` until it returns something truthy; fail naming ``what`` (and
        any process that died, with its log)."""
        def alive_and_probe() -> Any:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{what}: {name} exited with {proc.returncode}:\n"
                                         + self.log_tail(name))
            return probe()

        return wait_for(alive_and_probe, timeout, what, every)

    def close(self) -> dict[str, int]:
        """Stop every process, the last started first (SIGTERM, SIGKILL after 30 s: the
        collector takes about 8 s to stop on an idle machine, more on a loaded one); exit
        status per process."""
        codes = {}
        for name in reversed(self.procs):
            code = self.group.stop(name)
            assert code is not None, name  # stop() waited for it
            codes[name] = code
        self.group.close()  # any process a later one of its name replaced
        return codes


def start_collector(procs: Processes, tokens: Path, name: str = "collector",
                    timeout: float = START_TIMEOUT_S, **keys: Any) -> str:
    """``forewarn collector run`` on a free loopback port with its data under
    ``<tmp>/data``, the nodes of ``tokens`` enrolled, warnings only, and ``keys`` as
    further config; its URL once ``/healthz`` answers (its imports take half a minute on
    a loaded machine)."""
    url = f"http://127.0.0.1:{free_port()}"
    config = write_config(procs.tmp / f"{name}.toml", **{
        "listen": url.removeprefix("http://"), "data_dir": str(procs.tmp / "data"),
        "tokens_file": str(tokens), "log_level": "warning", **keys})
    procs.spawn(name, collector_command(config))
    procs.wait_for(f"{name} /healthz", lambda: http_get(f"{url}/healthz")[0] == 200, timeout)
    return url


def start_agent(procs: Processes, node: str, scenario: str, *, name: str = "",
                address: str = "", socket: Path | None = None, config: str = "",
                collector: str = "",
                token_file: Path | None = None, timeout: float = START_TIMEOUT_S, wait: bool = True,
                **kw: Any) -> str:
    """``forewarn agent --source sim`` of ``node`` playing the ``scenario`` (TOML text), its
    config file holding ``config``; with a ``collector`` it pushes every 0.5 s from a
    spool of its own. It listens on ``address`` (default: a free loopback port) and returns
    that ``host:port`` once ``/healthz`` answers (and its
    ``socket`` exists; at once without ``wait``, for agents started side by side).
    ``kw``: further :func:`agent_command` arguments."""
    name = name or f"agent-{node}"
    address = address or f"127.0.0.1:{free_port()}"
    scenario_file = procs.tmp / f"{name}-scenario.toml"
    scenario_file.write_text(scenario)
    config_file = procs.tmp / f"{name}.toml"
    config_file.write_text(config)
    env = {"FOREWARN_AGENT_WATCHDOG": "0"}
    if collector:
        env |= {"FOREWARN_AGENT_SPOOL_DIR": str(procs.tmp / f"spool-{name}"),
                "FOREWARN_AGENT_PUSH_INTERVAL_S": "0.5"}
    procs.spawn(name, agent_command(node, scenario=scenario_file, socket=socket,
                                    listen=address, config=config_file, collector=collector,
                                    token_file=token_file, **kw), env=env)
    if not wait:
        return address
    procs.wait_for(f"{name} /healthz" + (" and socket" if socket else ""),
                   lambda: http_get(f"http://{address}/healthz")[0] == 200
                   and (socket is None or socket.exists()), timeout)
    return address


def start_prometheus(procs: Processes, binary: str, targets: dict[str, str], *,
                     rules: Path | None = None, labels: dict[str, str] | None = None,
                     honor_labels: bool = False, extra: tuple[str, ...] = ()) -> str:
    """Prometheus scraping (and evaluating ``rules``) every second: one scrape job per
    ``targets`` entry (job name -> ``host:port``), each target carrying ``labels``.
    Returns its URL once ready."""
    lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s"]
    if rules is not None:
        lines += ["rule_files:", f"  - {rules}"]
    lines.append("scrape_configs:")
    for job, address in targets.items():
        lines.append(f"  - job_name: {job}")
        if honor_labels:
            lines.append("    honor_labels: true")
        lines += ["    static_configs:", f"      - targets: ['{address}']"]
        if labels:
            lines.append("        labels: {" + ", ".join(f"{k}: {v}" for k, v in labels.items())
                         + "}")
    config = procs.tmp / "prometheus.yml"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    procs.spawn("prometheus", [
        binary, f"--config.file={config}", f"--storage.tsdb.path={procs.tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", *extra], cwd=procs.tmp)
    url = f"http://127.0.0.1:{port}"
    procs.wait_for("prometheus ready", lambda: http_get(f"{url}/-/ready")[0] == 200,
                   START_TIMEOUT_S)
    return url


class _Sink(http.server.BaseHTTPRequestHandler):
    """Webhook receiver: answers 204 to everything (so deliveries are counted)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class Stack:
    """Collector + sim agent + toy job (+ Prometheus when asked), all real processes."""

    def __init__(self, tmp: Path, *, ranks: int = 3, nan_rank: int | None = 1,
                 hang_rank: int | None = 2, sim_speed: float = 2.0) -> None:
        self.tmp = tmp
        self.procs = Processes(tmp)
        self.ranks, self.nan_rank, self.hang_rank, self.sim_speed = (
            ranks, nan_rank, hang_rank, sim_speed)
        self.collector_url = ""
        self.agent_address = f"127.0.0.1:{free_port()}"
        self.socket = tmp / "agent.sock"
        self.prometheus_url = ""
        self.started = time.time()
        """Wall time the stack started (range queries start here)."""
        self.sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=self.sink.serve_forever, daemon=True).start()

    def wait_for(self, what: str, probe: Callable[[], Any], timeout: float = 60,
                 every: float = 0.25) -> Any:
        """:meth:`Processes.wait_for` of the stack's processes."""
        return self.procs.wait_for(what, probe, timeout, every)

    def start(self, prometheus: str | None = None) -> None:
        """Collector, (Prometheus, given its binary,) agent and the job's ranks (started,
        not yet heard). Prometheus comes before the agent: its rules see every counter from
        the agent's first sample on (the scenario's faults end seconds after its start)."""
        self.started = time.time()
        tokens = self.tmp / "tokens.toml"
        token_file = self.tmp / f"{NODE}.token"
        enroll(tokens, NODE, token_file)
        # checkpoint_default_s: the job has run for seconds only; with the 60 s default the
        # cost model would (rightly) find a few seconds of work not worth a checkpoint.
        # predict_*: score every second, on every sample: risk panels fill within the test.
        sink = f"http://127.0.0.1:{self.sink.server_address[1]}/hook"
        self.collector_url = start_collector(
            self.procs, tokens, webhook_urls=[sink], checkpoint_default_s=0.5,
            order_safety_s=2.0, predict_interval_s=1.0, predict_sample_s=0)
        if prometheus:
            self.start_prometheus(prometheus)
        start_agent(self.procs, NODE, SCENARIO, name="agent", address=self.agent_address,
                    socket=self.socket, collector=self.collector_url, token_file=token_file,
                    sim_speed=self.sim_speed, interval=0.5, extra=("--log-level", "warning"))
        script = self.tmp / "rank.py"
        script.write_text(RANK)
        out = self.tmp / "ckpt"
        out.mkdir()
        for rank in range(self.ranks):
            # local_rank == GPU index: rank r runs on GPU r of the node
            self.procs.spawn(f"rank{rank}", [
                sys.executable, str(script), JOB, str(rank), str(rank), str(self.ranks),
                str(self.socket), str(out),
                str(60 if rank == self.nan_rank else -1),
                str(40 if rank == self.hang_rank else -1)])

    def start_prometheus(self, binary: str) -> None:
        """Prometheus scraping agent and collector every second, with the rules loaded.

        ``honor_labels`` as deploy/prometheus.yml: the agent's ``node``/``gpu`` labels are kept;
        training jobs are ``training_job``, so the scrape ``job`` label is never overwritten.
        """
        self.prometheus_url = start_prometheus(
            self.procs, binary, {"forewarn-agent": self.agent_address,
                                 "forewarn-collector": self.collector_url.removeprefix("http://")},
            rules=RULES, labels={"cluster": CLUSTER}, honor_labels=True,
            extra=("--rules.alert.resend-delay=1s",))

    def close(self) -> dict[str, int]:
        """Stop everything (ranks first); exit status per process."""
        codes = self.procs.close()
        self.sink.shutdown()
        self.sink.server_close()
        return codes

    # -- Prometheus API ----------------------------------------------------------------

    def prom(self, path: str, **params: str) -> Any:
        url = f"{self.prometheus_url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        status, body = http_get(url, timeout=10)
        try:
            data = json.loads(body)
        except ValueError:
            data = {"status": "error", "error": f"HTTP {status}: {body[:200]!r}"}
        if data.get("status") != "success":
            raise PromError(str(data.get("error", data)))
        return data["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.prom("query", query=expr)["result"]
        return result

    def firing(self) -> dict[str, list[dict[str, str]]]:
        """Firing alerts by name, with their labels."""
        out: dict[str, list[dict[str, str]]] = {}
        for a in self.prom("alerts")["alerts"]:
            if a["state"] == "firing":
                out.setdefault(a["labels"]["alertname"], []).append(a["labels"])
        return out


class PromError(AssertionError):
    """Prometheus refused a query (bad PromQL, many-to-many matching, ...)."""


@contextlib.contextmanager
def running_stack(tmp: Path, prometheus: str | None = None,
                  **kw: Any) -> Iterator[Stack]:
    stack = Stack(tmp, **kw)
    try:
        stack.start(prometheus)
        yield stack
    finally:
        codes = stack.close()
    # uvicorn re-raises the SIGTERM it handled after a clean shutdown: -15 is a clean exit.
    for name, ok in (("collector", (0, -signal.SIGTERM)), ("agent", (0,))):
        assert name not in codes or codes[name] in ok, (
            f"{name} exited with {codes[name]}\n{stack.procs.log_tail(name)}")
