"""A real forewarn stack on loopback for tests: ``forewarn collector run`` (tmp data dir,
enrolled token), a real ``forewarn agent --source sim`` on one simulated node whose scenario
plays ECC, thermal, PCIe (ending in XID 79), row-remap and NVLink faults within seconds, a
small training job of rank processes using :class:`forewarn.hook.Monitor` (one may report a
NaN loss, one may hang) and, when asked, Prometheus (Debian package) scraping the agent and
the collector every second with ``dashboards/rules/forewarn.rules.yml`` loaded.

Used by tests/dashboards/test_dashboards_prometheus.py and
tests/collector/test_status_page_browser.py."""

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

from forewarn.collector.http.auth import add_token

from support.polling import free_port, wait_for

__all__ = ["CLUSTER", "DASHBOARDS", "JOB", "NODE", "RULES", "PromError", "Stack",
           "http_get", "running_stack", "stop"]

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


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` s; the exit status. (The collector takes
    about 8 s to stop on an idle machine, more on a loaded one.)"""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


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
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Any] = []
        self.ranks, self.nan_rank, self.hang_rank, self.sim_speed = (
            ranks, nan_rank, hang_rank, sim_speed)
        self.collector_url = f"http://127.0.0.1:{free_port()}"
        self.agent_address = f"127.0.0.1:{free_port()}"
        self.socket = tmp / "agent.sock"
        self.prometheus_url = ""
        self.started = time.time()
        """Wall time the stack started (range queries start here)."""
        self.sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=self.sink.serve_forever, daemon=True).start()

    # -- processes ---------------------------------------------------------------------

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        self.logs.append(log)
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("FOREWARN_") and k != "NOTIFY_SOCKET"}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env={**base, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=cwd)
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def wait_for(self, what: str, probe: Callable[[], Any], timeout: float = 60,
                 every: float = 0.25) -> Any:
        """Poll ``probe`` until it returns something truthy; fail naming ``what`` (and
        any stack process that died, with its log)."""
        def alive_and_probe() -> Any:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{what}: {name} exited with {proc.returncode}:\n"
                                         + self.log_tail(name))
            return probe()

        return wait_for(alive_and_probe, timeout, what, every)

    def start(self) -> None:
        """Collector, agent and the job's ranks (started, not yet heard)."""
        self.started = time.time()
        tokens = self.tmp / "tokens.toml"
        token_file = self.tmp / f"{NODE}.token"
        token_file.write_text(add_token(tokens, NODE) + "\n")
        token_file.chmod(0o600)
        config = self.tmp / "collector.toml"
        # checkpoint_default_s: the job has run for seconds only; with the 60 s default the
        # cost model would (rightly) find a few seconds of work not worth a checkpoint.
        config.write_text(
            f'listen = "{self.collector_url.removeprefix("http://")}"\n'
            f'data_dir = "{self.tmp / "data"}"\ntokens_file = "{tokens}"\n'
            'log_level = "warning"\n'
            f'webhook_urls = ["http://127.0.0.1:{self.sink.server_address[1]}/hook"]\n'
            'checkpoint_default_s = 0.5\norder_safety_s = 2.0\n'
            # score every second, on every sample: risk panels fill within the test
            'predict_interval_s = 1.0\npredict_sample_s = 0\n')
        self.spawn("collector", [sys.executable, "-m", "forewarn", "collector", "--config",
                                 str(config), "run"])
        self.wait_for("collector /healthz",
                      lambda: http_get(f"{self.collector_url}/healthz")[0] == 200)
        scenario = self.tmp / "scenario.toml"
        scenario.write_text(SCENARIO)
        self.spawn("agent", [
            sys.executable, "-m", "forewarn", "agent", "--source", "sim",
            "--scenario", str(scenario), "--sim-speed", str(self.sim_speed),
            "--interval", "0.5", "--node", NODE, "--listen", self.agent_address,
            "--socket", str(self.socket), "--no-kmsg", "--collector", self.collector_url,
            "--token-file", str(token_file), "--log-level", "warning"],
            env={"FOREWARN_AGENT_SPOOL_DIR": str(self.tmp / "spool"),
                 "FOREWARN_AGENT_PUSH_INTERVAL_S": "0.5", "FOREWARN_AGENT_WATCHDOG": "0"})
        self.wait_for("agent /healthz and socket",
                      lambda: http_get(f"http://{self.agent_address}/healthz")[0] == 200
                      and self.socket.exists())
        script = self.tmp / "rank.py"
        script.write_text(RANK)
        out = self.tmp / "ckpt"
        out.mkdir()
        for rank in range(self.ranks):
            # local_rank == GPU index: rank r runs on GPU r of the node
            self.spawn(f"rank{rank}", [
                sys.executable, str(script), JOB, str(rank), str(rank), str(self.ranks),
                str(self.socket), str(out),
                str(60 if rank == self.nan_rank else -1),
                str(40 if rank == self.hang_rank else -1)])

    def start_prometheus(self, binary: str) -> None:
        """Prometheus scraping agent and collector every second, with the rules loaded.

        ``honor_labels`` as deploy/prometheus.yml: the agent's ``node``/``gpu`` labels are kept;
        training jobs are ``training_job``, so the scrape ``job`` label is never overwritten.
        """
        config = self.tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {RULES}\n"
            "scrape_configs:\n"
            "  - job_name: forewarn-agent\n    honor_labels: true\n    static_configs:\n"
            f"      - targets: ['{self.agent_address}']\n"
            f"        labels: {{cluster: {CLUSTER}}}\n"
            "  - job_name: forewarn-collector\n    honor_labels: true\n    static_configs:\n"
            f"      - targets: ['{self.collector_url.removeprefix('http://')}']\n"
            f"        labels: {{cluster: {CLUSTER}}}\n")
        port = free_port()
        self.spawn("prometheus", [
            binary, f"--config.file={config}", f"--storage.tsdb.path={self.tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--rules.alert.resend-delay=1s"],
            cwd=self.tmp)
        self.prometheus_url = f"http://127.0.0.1:{port}"
        self.wait_for("prometheus ready",
                      lambda: http_get(f"{self.prometheus_url}/-/ready")[0] == 200)

    def close(self) -> dict[str, int]:
        """Stop everything (ranks first); exit status per process."""
        codes = {name: stop(proc) for name, proc in reversed(self.procs.items())}
        for log in self.logs:
            log.close()
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
        stack.start()
        if prometheus:
            stack.start_prometheus(prometheus)
        yield stack
    finally:
        codes = stack.close()
    # uvicorn re-raises the SIGTERM it handled after a clean shutdown: -15 is a clean exit.
    for name, ok in (("collector", (0, -signal.SIGTERM)), ("agent", (0,))):
        assert name not in codes or codes[name] in ok, (
            f"{name} exited with {codes[name]}\n{stack.log_tail(name)}")
