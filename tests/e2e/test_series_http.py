"""The series store under a SIGKILLed collector with agents on HTTP (``uplink = "http"``,
issue 16): a real ``forewarn collector run`` process remote-writes to a real
VictoriaMetrics, two agents (the real HTTP uplink and spool) push to it. The store stalls
(SIGSTOP), so the collector holds samples it stored but has not written; it is SIGKILLed
holding them and started again. Once the store resumes, every sample the agents sent is in
it, once: the agents keep a batch in their spools until the collector has written its
samples, and send it again to the restarted collector."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from forewarn.chaos.exposition import scrape
from forewarn.collector.http.auth import hash_token
from forewarn.demo.servers import VictoriaMetrics
from forewarn.spawn.commands import write_config

from support.bus_stack import TOKENS, FedAgent
from support.polling import free_port, poll, wait_for
from support.stack import Processes, http_get

MATCH = 'forewarn_gpu_info{node=~"gpu.*"}'
ERRORS = "forewarn_uplink_push_errors_total"


def points(vm: VictoriaMetrics) -> tuple[int, int]:
    """Distinct (series, time) points of :data:`MATCH` in the store, and copies over that."""
    distinct = raw = 0
    for series in vm.export(MATCH):
        raw += len(series["timestamps"])
        distinct += len(set(series["timestamps"]))
    return distinct, raw - distinct


@pytest.mark.system
@pytest.mark.timeout(240)
def test_samples_a_killed_collector_held_for_a_stalled_store_arrive_once(
        tmp_path: Path, require_binary: Callable[[str], str]) -> None:
    vm = VictoriaMetrics(require_binary("victoria-metrics"), root=tmp_path / "vm")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text("".join(f'"{n}" = "{hash_token(t)}"\n' for n, t in TOKENS.items()))
    url = f"http://127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "collector.toml", listen=url.removeprefix("http://"),
                          data_dir=str(tmp_path / "data"), tokens_file=str(tokens),
                          log_level="warning", remote_write_url=vm.write_url)
    procs = Processes(tmp_path)

    def start(name: str) -> None:
        procs.spawn(name, [sys.executable, "-m", "forewarn", "collector", "--config",
                           str(config), "run"])
        procs.wait_for(f"{name} /healthz", lambda: http_get(f"{url}/healthz")[0] == 200, 120)

    agents: list[FedAgent] = []
    stopped = False
    try:
        start("collector")
        agents = [FedAgent(tmp_path, url, node, uplink="http").start() for node in TOKENS]
        wait_for(lambda: vm.export(MATCH), 30, "samples in the series store")
        vm.proc.send_signal(signal.SIGSTOP)
        stopped = True
        at_stall = sum(a.sent for a in agents)
        errors = [a.metric(ERRORS) for a in agents]
        # Each agent holds a batch the collector stored but could not write (answered 503).
        # Not "stored batches rose by one per agent": a batch in flight at the stall was
        # stored before it and comes again only as a duplicate, so that count can stay put.
        wait_for(lambda: sum(a.sent for a in agents) >= at_stall + 80
                 and all(a.metric(ERRORS) > e for a, e in zip(agents, errors, strict=True)), 60,
                 "each agent answered 503 while the series store stalls")
        victim = procs.procs.pop("collector")
        victim.kill()
        victim.wait(10)
        vm.proc.send_signal(signal.SIGCONT)
        stopped = False
        start("collector-again")
        for a in agents:
            a.drain()
        sent = sum(a.sent for a in agents)
        poll(lambda: points(vm)[0] >= sent, 60, 0.5)  # the remote write still sending
        assert points(vm) == (sent, 0), f"{sent} samples sent; (stored, copies) above"
        # the batches the killed one answered 503 came again: duplicates, sent again
        assert (scrape(url + "/metrics",
                       "forewarn_collector_remote_write_resent_samples_total") or 0) > 0
    finally:
        if stopped:
            vm.proc.send_signal(signal.SIGCONT)
        for a in agents:
            a.stop()
        procs.close()
        vm.stop()
