"""Every query of every panel of every dashboard returns data from a real Prometheus.

A real stack on loopback: ``forewarn collector run`` (tmp data dir, enrolled token), a real
``forewarn agent --source sim`` on one simulated node whose scenario plays ECC, thermal,
PCIe (ending in XID 79), row-remap and NVLink faults within seconds, a small training job
of three rank processes using :class:`forewarn.hook.Monitor` (one reports a NaN loss, one
hangs), and Prometheus (Debian package) scraping the agent and the collector every second
with ``dashboards/rules/forewarn.rules.yml`` loaded.

Then every panel target and annotation of ``dashboards/*.json`` is run against
Prometheus's HTTP API with the template variables set to the stack's cluster, node and job
(a panel that can never show data is a bug), every variable's ``label_values`` query must
find values, and the alert rules must fire on the injected faults.

The stack is reusable (:class:`Stack`): tests/test_status_page_browser.py starts one too.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import socket
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

import pytest

from forewarn.collector.auth import add_token

ROOT = Path(__file__).resolve().parent.parent
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
while True:
    time.sleep(0.05)
    step += 1
    if step == hang_at:
        time.sleep(3600)  # hung: beats go on, steps stop
    loss = float("nan") if 0 <= nan_at <= step else 2.0 / step
    m.step(step, loss=loss, grad_norm=0.5 + 0.01 * rank)
    if m.should_checkpoint(step):
        t0 = time.monotonic()
        (out / f"rank{rank}-step{step}.ckpt").write_bytes(b"x" * 4096)
        m.checkpoint_done(step, time.monotonic() - t0 + 0.01, 4096, str(out))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{what}: {name} exited with {proc.returncode}:\n"
                                         + self.log_tail(name))
            result = probe()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(every)

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

        ``honor_labels``: rank series (and the collector's per-job series) carry the training
        ``job`` label, which must not be renamed ``exported_job`` (as deploy/prometheus.yml).
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


# -- the dashboards' queries --------------------------------------------------------------

VARIABLES = {
    "cluster": CLUSTER, "node": NODE, "job": JOB, "gpu": ".*",
    "__rate_interval": "1m", "__interval": "15s", "__range": "5m",
}


def substitute(expr: str) -> str:
    """Grafana's template variables as a dashboard user with this stack selected sees them."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in VARIABLES:
            raise AssertionError(f"unknown template variable ${name} in {expr!r}")
        return VARIABLES[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def dashboard_queries() -> list[tuple[str, str, bool]]:
    """``(where, expr, instant)`` for every panel target and annotation of every dashboard."""
    out: list[tuple[str, str, bool]] = []
    files = sorted(DASHBOARDS.glob("*.json"))
    assert len(files) >= 5, files
    for path in files:
        dash = json.loads(path.read_text())
        panels = [p for p in dash["panels"] if p.get("type") != "row"]
        panels += [q for p in dash["panels"] for q in p.get("panels", [])]  # collapsed rows
        for p in panels:
            for t in p.get("targets", []):
                where = f"{path.name} / panel {p['title']!r} / {t.get('refId', '?')}"
                out.append((where, t["expr"], bool(t.get("instant"))))
        for a in dash.get("annotations", {}).get("list", []):
            if a.get("expr"):
                out.append((f"{path.name} / annotation {a['name']!r}", a["expr"], False))
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """``(where, selector, label)`` for every ``label_values(selector, label)`` variable."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for v in json.loads(path.read_text())["templating"]["list"]:
            q = v.get("query")
            text = q.get("query", "") if isinstance(q, dict) else str(q or "")
            if v.get("type") != "query":
                continue
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text.strip())
            assert m, f"{path.name} / variable {v['name']}: not a label_values query: {text!r}"
            out.append((f"{path.name} / variable ${v['name']}", m.group(1), m.group(2)))
    return out


def run_panel_query(stack: Stack, expr: str, instant: bool, since: float
                    ) -> list[dict[str, Any]]:
    """Series the query returns as Grafana runs it: instant at now, or over the range."""
    q = substitute(expr)
    if instant:
        return stack.query(q)
    now = time.time()
    data = stack.prom("query_range", query=q, start=f"{since:.3f}", end=f"{now:.3f}",
                      step="1")
    result: list[dict[str, Any]] = data["result"]
    return result


def joined_labels_wrong(expr: str, series: list[dict[str, Any]]) -> str:
    """Panels that join labels in (the node of an agent's self-metrics, the job and rank
    over a GPU) must carry the stack's values; '' when they do."""
    want: dict[str, str] = {}
    if "group_left(node)" in expr:
        want["node"] = NODE
    if "forewarn_rank_info" in expr:
        want.update(node=NODE, job=JOB)
    for s in series:
        got = {k: s["metric"].get(k) for k in want}
        if got != want or ("forewarn_rank_info" in expr and not s["metric"].get("rank")):
            return f"series {s['metric']} lacks {want} (or a rank)"
    return ""


EXPECTED_ALERTS: dict[str, dict[str, str]] = {
    "ForewarnGpuUnhealthy": {"node": NODE},
    "ForewarnGpuLost": {"node": NODE, "gpu": "3"},
    "ForewarnXidHardware": {"node": NODE, "gpu": "3", "code": "79", "class": "bus"},
    "ForewarnEccUncorrectable": {"node": NODE, "gpu": "1"},
    "ForewarnRowRemapFailure": {"node": NODE, "gpu": "4"},
    "ForewarnNanLoss": {"node": NODE, "job": JOB, "rank": "1"},
    "ForewarnRankHang": {"node": NODE, "job": JOB, "rank": "2"},
}
"""Alerts the injected faults must fire, each with labels one firing instance must carry."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory,
          require_binary: Callable[[str], str]) -> Iterator[Stack]:
    prometheus = require_binary("prometheus")
    with running_stack(tmp_path_factory.mktemp("dash"), prometheus) as s:
        s.wait_for("first scrape of agent and collector",
                   lambda: len(s.query("up == 1")) == 2, timeout=60)
        yield s


@pytest.mark.timeout(180)
def test_rules_fire_on_injected_faults(stack: Stack) -> None:
    def all_firing() -> bool:
        firing = stack.firing()
        return all(any(labels.items() <= a.items() for a in firing.get(name, []))
                   for name, labels in EXPECTED_ALERTS.items())

    try:
        stack.wait_for("the alerts of the injected faults", all_firing, timeout=60, every=1)
    except AssertionError as exc:
        firing = stack.firing()
        missing = {n: want for n, want in EXPECTED_ALERTS.items()
                   if not any(want.items() <= a.items() for a in firing.get(n, []))}
        raise AssertionError(f"{exc}\nnot firing (with these labels): {missing}\n"
                             f"firing: {json.dumps(firing, indent=1)}") from None
    firing = stack.firing()
    xids = {a["code"] for a in firing["ForewarnXidHardware"]}
    assert {"48", "64", "74", "79"} <= xids, xids  # every hardware XID of the scenario
    for name in firing:  # checkpoint-worthy alerts name what to checkpoint
        assert name.startswith("Forewarn"), name
    # The pipeline itself is fine: nothing says otherwise.
    assert not {"ForewarnAgentDown", "ForewarnCollectorUnreachable", "ForewarnSpoolDropping"
                } & firing.keys(), firing.keys()


@pytest.mark.timeout(180)
def test_every_panel_query_returns_data(stack: Stack) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 40, len(queries)
    # Wait for the slowest signals (the last terminal fault, the job's checkpoint, the
    # collector's decisions), then allow a few more seconds for anything still to come.
    stack.wait_for("XID 79, a saved checkpoint and a collector decision", lambda: (
        stack.query(f'forewarn_gpu_xid_errors_total{{node="{NODE}",code="79"}}')
        and stack.query(f'forewarn_checkpoint_bytes{{job="{JOB}"}}')
        and stack.query("forewarn_collector_decisions_total")), timeout=60, every=1)
    since = stack.started
    pending = {where: (expr, instant) for where, expr, instant in queries}
    errors: dict[str, str] = {}
    deadline = time.monotonic() + 15
    while pending:
        for where, (expr, instant) in list(pending.items()):
            try:
                series = run_panel_query(stack, expr, instant, since)
                if series:
                    del pending[where]
                    if wrong := joined_labels_wrong(expr, series):
                        errors[where] = f"{substitute(expr)}\n      error: {wrong}"
            except PromError as exc:
                errors[where] = f"{substitute(expr)}\n      error: {exc}"
                del pending[where]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(1)
    empty = {w: substitute(e) for w, (e, _i) in pending.items()}

    bad_vars = []
    for where, selector, label in variable_queries():
        sel = substitute(selector)
        rows = stack.query(f"count by ({label}) ({sel})")
        if not [r for r in rows if r["metric"].get(label)]:
            bad_vars.append(f"{where}: no {label!r} values in {sel}")

    report = "".join(f"\n  {w}\n      {e}" for w, e in sorted(empty.items()))
    report += "".join(f"\n  {w}\n      {e}" for w, e in sorted(errors.items()))
    report += "".join(f"\n  {v}" for v in bad_vars)
    assert not (empty or errors or bad_vars), (
        f"{len(empty)} of {len(queries)} panel queries return no series, "
        f"{len(errors)} fail, {len(bad_vars)} variables find nothing:{report}")
