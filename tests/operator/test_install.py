"""forewarn as an operator installs it: ``python -m build`` makes an sdist and a wheel, pip
installs the wheel with its dependencies into a fresh virtual environment (not the
editable checkout; see conftest.py), ``forewarn deploy install --prefix`` writes each
role's unit, config and directories, and the unit's own ExecStart command line starts
the service."""

from __future__ import annotations

import configparser
import os
import shlex
import stat
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forewarn.demo.launch import free_port

from support.paths import TESTS

pytestmark = pytest.mark.timeout(900)

DATA = TESTS / "data"


def _run(argv: list[str],
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def venv(install_wheel: Callable[[Path], None],
         tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel and the collector extra installed."""
    env_dir = tmp_path_factory.mktemp("venv") / "forewarn"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    assert r.returncode == 0, r.stderr
    install_wheel(env_dir)
    return env_dir


def test_build_makes_sdist_and_wheel_with_deploy_files(dist: tuple[Path, str]) -> None:
    out, log = dist
    assert len(list(out.glob("forewarn-*.tar.gz"))) == 1
    (wheel,) = out.glob("forewarn-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("forewarn-agent.service", "forewarn-collector.service", "agent.toml",
                 "collector.toml", "60-forewarn.conf", "prometheus.yml", "alertmanager.yml"):
        assert f"forewarn/deploy/{name}" in names, name
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "no LICENSE"
    # No setuptools warning wall: data folders are declared packages.
    assert "Warning" not in log, [line for line in log.splitlines() if "Warning" in line]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _exec_start(unit: Path) -> list[str]:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read_string(unit.read_text())
    return shlex.split(cp["Service"]["ExecStart"])


def _install(venv: Path, role: str, prefix: Path) -> list[str]:
    r = _run([str(venv / "bin" / "forewarn"), "deploy", "install", "--role", role,
              "--prefix", str(prefix)])
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()


def _as_unit_would(argv: list[str], prefix: Path) -> list[str]:
    """The unit's command line, its config read from under ``prefix``."""
    i = argv.index("--config") + 1
    return [*argv[:i], str(prefix / argv[i].lstrip("/")), *argv[i + 1:]]


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _serve(started: list[subprocess.Popen[bytes]], argv: list[str], env: dict[str, str],
           url: str, log: Path) -> None:
    from forewarn.spawn.procs import wait_http

    with log.open("ab") as out:
        p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    started.append(p)
    wait_http(url, 60, p, log)


def test_deploy_install_collector_and_agent_units_start(
        venv: Path, tmp_path: Path, started: list[subprocess.Popen[bytes]],
        require_binary: Callable[[str], str]) -> None:
    forewarn = str(venv / "bin" / "forewarn")
    prefix = tmp_path / "root"
    said = _install(venv, "collector", prefix) + _install(venv, "agent", prefix)
    units = prefix / "etc" / "systemd" / "system"
    for role in ("collector", "agent"):
        unit = units / f"forewarn-{role}.service"
        assert _mode(unit) == 0o644 and _exec_start(unit)[0] == forewarn, unit.read_text()
        config = prefix / "etc" / "forewarn" / f"{role}.toml"
        assert _mode(config) == 0o644 and f"forewarn {role} configuration" in config.read_text()
        assert any(str(unit) in line for line in said), said
    assert _mode(prefix / "etc" / "forewarn") == 0o755
    assert _mode(prefix / "var" / "lib" / "forewarn-collector") == 0o700
    assert _mode(prefix / "var" / "lib" / "forewarn") == 0o700
    # A second install keeps the operator's config.
    config = prefix / "etc" / "forewarn" / "collector.toml"
    config.write_text(config.read_text() + "\n# edited by the operator\n")
    again = _install(venv, "collector", prefix)
    assert "edited by the operator" in config.read_text()
    assert any("kept" in line and str(config) in line for line in again), again

    # The collector from its unit's command line, its state under the prefix.
    port = free_port()
    state = prefix / "var" / "lib" / "forewarn-collector"
    cenv = dict(os.environ, FOREWARN_COLLECTOR_LISTEN=f"127.0.0.1:{port}",
                FOREWARN_COLLECTOR_DATA_DIR=str(state),
                FOREWARN_COLLECTOR_TOKENS_FILE=str(state / "tokens.toml"),
                FOREWARN_COLLECTOR_ALERT_TOKEN=ALERT_TOKEN)
    cenv.pop("PYTHONPATH", None)
    collector = f"http://127.0.0.1:{port}"
    _serve(started, _as_unit_would(_exec_start(units / "forewarn-collector.service"), prefix),
           cenv, collector + "/healthz", tmp_path / "collector.log")
    # Enrol the node while the collector runs, as the README says.
    add = _run([forewarn, "collector", "--config", str(config), "token", "add", "node-1"],
               env=cenv)
    assert add.returncode == 0, add.stderr
    token = prefix / "etc" / "forewarn" / "agent.token"
    token.write_text(add.stdout.strip() + "\n")
    token.chmod(0o600)

    aport = free_port()
    aenv = dict(cenv, FOREWARN_AGENT_NODE="node-1", FOREWARN_AGENT_SOURCE="sim",
                FOREWARN_AGENT_SCENARIO=str(DATA / "gpu1-off-the-bus.toml"),
                FOREWARN_AGENT_KMSG="false", FOREWARN_AGENT_LISTEN=f"127.0.0.1:{aport}",
                FOREWARN_AGENT_SOCKET_PATH=str(tmp_path / "agent.sock"),
                FOREWARN_AGENT_SPOOL_DIR=str(prefix / "var" / "lib" / "forewarn" / "spool"),
                FOREWARN_AGENT_COLLECTOR_URL=collector, FOREWARN_AGENT_TOKEN_FILE=str(token),
                FOREWARN_AGENT_PUSH_INTERVAL_S="0.5")
    agent_argv = _as_unit_would(_exec_start(units / "forewarn-agent.service"), prefix)

    def start_agent(scenario: str) -> subprocess.Popen[bytes]:
        """The installed agent from its unit's command line, playing ``scenario``."""
        _serve(started, agent_argv, dict(aenv, FOREWARN_AGENT_SCENARIO=str(DATA / scenario)),
               f"http://127.0.0.1:{aport}/healthz", tmp_path / "agent.log")
        return started[-1]

    agent = start_agent("gpu1-off-the-bus.toml")
    from forewarn.spawn.procs import get_json, wait_until

    def node_seen() -> bool:
        return any(n.get("node") == "node-1" for n in get_json(collector + "/api/v1/nodes"))

    assert wait_until(node_seen, 60), (tmp_path / "agent.log").read_text()[-3000:]

    def heal() -> None:
        """The condition goes: the agent restarts with GPU 1 healthy again (a reset GPU)."""
        started.remove(agent)
        agent.terminate()
        assert agent.wait(timeout=30) == 0, (tmp_path / "agent.log").read_text()[-3000:]
        start_agent("gpus2-healthy.toml")

    _alert_fires_and_resolves(venv, tmp_path, collector, f"127.0.0.1:{aport}",
                              f"127.0.0.1:{port}", started, heal, require_binary)


ALERT_TOKEN = "operator-alert-token-0123456789"
# What the shipped rules fire when GPU 1 falls off the bus (XID 79, NVML "lost").
ALERTS = ("ForewarnGpuUnhealthy", "ForewarnGpuLost", "ForewarnXidHardware")


def _shipped(venv: Path, name: str, replace: dict[str, str]) -> str:
    """The wheel's example ``name`` (``forewarn deploy print``) with each key of ``replace``
    replaced: only addresses, paths and timings a test must set."""
    printed = _run([str(venv / "bin" / "forewarn"), "deploy", "print", name])
    assert printed.returncode == 0, printed.stderr
    text = printed.stdout
    for old, new in replace.items():
        assert old in text, f"the shipped {name} no longer has {old!r}"
        text = text.replace(old, new)
    return text


def _alertmanager(venv: Path, tmp_path: Path, collector: str,
                  started: list[subprocess.Popen[bytes]], binary: str) -> str:
    """Alertmanager with the wheel's example config, pointed at ``collector`` with the alert
    token in its credentials file; its address (host:port)."""
    token = tmp_path / "alert-token"
    token.write_text(ALERT_TOKEN + "\n")
    config = _shipped(venv, "alertmanager.yml", {
        "http://forewarn-collector:9404": collector,
        "/etc/alertmanager/forewarn-alert-token": str(token)})
    assert "send_resolved: true" in config
    (tmp_path / "alertmanager.yml").write_text(config)
    address = f"127.0.0.1:{free_port()}"
    _serve(started, [binary, f"--config.file={tmp_path / 'alertmanager.yml'}",
                     f"--storage.path={tmp_path / 'am'}", "--cluster.listen-address=",
                     f"--web.listen-address={address}"],
           dict(os.environ), f"http://{address}/-/ready", tmp_path / "alertmanager.log")
    return address


def _prometheus(venv: Path, tmp_path: Path, agent: str, collector: str, alertmanager: str,
                started: list[subprocess.Popen[bytes]], binary: str) -> str:
    """Prometheus with the wheel's example config and rule file (scraping and evaluating
    every second) scraping the installed agent and collector and
    sending to ``alertmanager``; its URL."""
    rules = tmp_path / "forewarn.rules.yml"  # the wheel's rules, as an operator gets them
    rules.write_text(_shipped(venv, "rules/forewarn.rules.yml", {}))
    config = _shipped(venv, "prometheus.yml", {
        "scrape_interval: 15s": "scrape_interval: 1s",
        "evaluation_interval: 15s": "evaluation_interval: 1s",
        "scrape_interval: 5s": "scrape_interval: 1s",
        "/etc/prometheus/forewarn.rules.yml": str(rules),
        "alertmanager:9093": alertmanager,
        '"gpu-node-001:9403", "gpu-node-002:9403"': f'"{agent}"',
        "forewarn-collector:9404": collector})
    (tmp_path / "prometheus.yml").write_text(config)
    url = f"http://127.0.0.1:{free_port()}"
    _serve(started, [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                     f"--web.listen-address={url.removeprefix('http://')}"],
           dict(os.environ), url + "/-/ready", tmp_path / "prometheus.log")
    return url


def _alert_fires_and_resolves(venv: Path, tmp_path: Path, collector: str, agent: str,
                              collector_address: str, started: list[subprocess.Popen[bytes]],
                              heal: Callable[[], None],
                              require_binary: Callable[[str], str]) -> None:
    """Issue 13's operator leg, every part real and shipped: a real Prometheus scrapes the
    installed agent (GPU 1 off the bus) and fires the shipped rules
    (dashboards/rules/forewarn.rules.yml), the real Alertmanager (the wheel's example
    config, only its addresses set) sends them to the installed collector, and the status
    page (headless Chromium) shows them firing in GPU 1's incident. The condition goes (the
    agent restarts with healthy GPUs): Prometheus resolves the alerts, Alertmanager sends
    them resolved at its group's next interval (30 s in the example) and the page shows
    each resolved, the incident ended and GPU 1 no longer red, without a reload. The rules
    it fires have no ``for:`` (ForewarnGpuUnhealthy's is 0s): the rule file is loaded as
    shipped, unchanged."""
    chromium = require_binary("chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    am = _alertmanager(venv, tmp_path, collector, started,
                       require_binary("prometheus-alertmanager"))
    _prometheus(venv, tmp_path, agent, collector_address, am, started,
                require_binary("prometheus"))
    incident = '#incidents tr[data-scope="gpu:node-1/1"]'
    finding = incident + ' .finding[data-check="alert:{}"][data-state="{}"]'
    gpu = '#fleet .node[data-node="node-1"] .cell[data-gpu="1"][data-health="{}"]'
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium,
                                     args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(collector + "/")
            for alert in ALERTS:  # Prometheus' first scrape and evaluation, then Alertmanager
                page.locator(finding.format(alert, "firing")).wait_for(timeout=60_000)
            page.locator(gpu.format("unhealthy")).wait_for(timeout=10_000)
            page.screenshot(path=str(tmp_path / "incident-firing.png"), full_page=True)
            heal()
            for alert in ALERTS:  # resolved at the group's next interval (30 s)
                page.locator(finding.format(alert, "resolved")).wait_for(timeout=90_000)
            # Every finding of the incident is over (the agent's too): the incident ends.
            page.locator(f"{incident}.recovered").wait_for(timeout=10_000)
            assert page.locator(f"{incident}:not(.recovered)").count() == 0
            page.locator(gpu.format("healthy")).wait_for(timeout=10_000)
            page.screenshot(path=str(tmp_path / "incident-resolved.png"), full_page=True)
        finally:
            browser.close()
