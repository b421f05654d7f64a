"""The agent daemon: poll cycle, finding transitions, components, source failures, XID
mapping, the ticker and the HTTP endpoints. Driven by the ScriptedBackend test double at
the hardware seam and fake clocks; the HTTP server is real (loopback)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from forewarn.agent.checks.xid import XidCheck
from forewarn.agent.config import AgentConfig
from forewarn.agent.daemon import Agent
from forewarn.agent.protocols import AgentHost, ComponentBase, Poll
from forewarn.agent.testing import FakeClock, ScriptedBackend, ScriptedXidSource
from forewarn.wire import Finding, Health, Subject, SuggestedAction, XidEvent


def quiet(gpu: int, t: float) -> dict[str, Any]:
    return {"temperature_c": 40.0 + gpu, "power_w": 100.0}


def make_agent(backend: ScriptedBackend | None = None, **kw: Any) -> tuple[Agent, FakeClock]:
    clock = FakeClock()
    mono = FakeClock(now=100.0)
    config = AgentConfig(node="node0", listen="127.0.0.1:0", kmsg=False)
    agent = Agent(config, backend or ScriptedBackend(quiet), clock=clock, monotonic=mono,
                  checks=kw.pop("checks", [XidCheck()]), retry_s=5.0, **kw)
    agent._test_mono = mono  # type: ignore[attr-defined]
    return agent, clock


class Recorder(ComponentBase):
    """A component that records what the agent hands it."""

    name = "recorder"

    def __init__(self) -> None:
        self.agent: AgentHost | None = None
        self.polls: list[Poll] = []
        self.stopped = False

    def start(self, agent: AgentHost) -> None:
        self.agent = agent

    def on_poll(self, poll: Poll) -> None:
        self.polls.append(poll)

    def stop(self) -> None:
        self.stopped = True


def test_poll_samples_runs_checks_and_reports_transitions_once() -> None:
    backend = ScriptedBackend(quiet, gpus=2)
    agent, clock = make_agent(backend)
    rec = Recorder()
    agent.add_component(rec)
    agent.start(serve=False)
    assert rec.agent is agent
    first = agent.poll_once()
    assert [s.gpu for s in first.samples] == [0, 1]
    # First judgement of each GPU is a transition from "never judged".
    assert {(t.previous, t.finding.health) for t in first.transitions} == {(None, Health.HEALTHY)}
    clock.advance(1)
    assert agent.poll_once().transitions == ()
    clock.advance(1)
    backend.queue_xid(79, gpu=1, time=clock.now)
    poll = agent.poll_once()
    assert [x.code for x in poll.xids] == [79]
    (t,) = poll.transitions
    assert t.previous == Health.HEALTHY and t.finding.health == Health.UNHEALTHY
    assert t.finding.subject.gpu == 1 and t.finding.action == SuggestedAction.REBOOT
    assert len(rec.polls) == 3
    agent.stop()
    assert rec.stopped and backend.closed == 1


def test_growing_evidence_under_an_unchanged_finding_is_reported_again() -> None:
    """Issue 14 row_remap_failure: remapped rows grow under one unchanged "remap pending"
    (degraded, reset) finding; each material growth is a transition the uplink sends."""
    from forewarn.agent.checks.remap import RemapCheck

    rows = {"n": 1}
    backend = ScriptedBackend(lambda gpu, t: {**quiet(gpu, t), "remap_pending": gpu == 0,
                                              "remap_failure": False,
                                              "remapped_rows_correctable": rows["n"] * (gpu == 0),
                                              "remapped_rows_uncorrectable": 0}, gpus=2)
    agent, clock = make_agent(backend, checks=[RemapCheck()])
    agent.start(serve=False)
    reported = []
    for n in (1, 1, 2, 2, 3, 3, 7, 8):
        rows["n"] = n
        clock.advance(1)
        reported += [t.finding.evidence["extent"] for t in agent.poll_once().transitions
                     if t.finding.subject.gpu == 0]
    assert reported == [1, 2, 3, 7], reported
    agent.stop()


def test_component_failure_is_contained() -> None:
    class Broken(ComponentBase):
        name = "broken"

        def on_poll(self, poll: Poll) -> None:
            raise RuntimeError("boom")

    agent, _ = make_agent()
    agent.add_component(Broken())
    rec = Recorder()
    agent.add_component(rec)
    agent.start(serve=False)
    agent.poll_once()
    agent.poll_once()
    assert len(rec.polls) == 2
    assert agent._component_errors == 2
    agent.stop()


def test_source_unavailable_is_marked_and_retried() -> None:
    backend = ScriptedBackend(quiet)
    backend.fail_open = True
    agent, _ = make_agent(backend)
    mono: FakeClock = agent._test_mono  # type: ignore[attr-defined]
    agent.start(serve=False)
    assert agent.poll_once().samples == ()
    snap = agent.exporter.snapshot
    assert snap.sources[0].up is False and snap.sources[0].errors_total >= 1
    backend.fail_open = False
    mono.advance(1)
    agent.poll_once()
    assert backend.opens == 1, "retried before retry_s passed"
    mono.advance(5)
    assert len(agent.poll_once().samples) == 2
    assert agent.exporter.snapshot.sources[0].up is True
    # Failing at runtime: marked down, closed, reopened later.
    backend.fail_sample = True
    mono.advance(1)
    assert agent.poll_once().samples == ()
    assert agent.exporter.snapshot.sources[0].up is False and backend.closed == 1
    backend.fail_sample = False
    mono.advance(6)
    assert len(agent.poll_once().samples) == 2 and backend.opens == 3
    agent.stop()


def test_kmsg_bus_ids_map_to_gpus_and_cross_source_duplicates_drop() -> None:
    backend = ScriptedBackend(quiet, gpus=2)
    kmsg = ScriptedXidSource()
    agent, clock = make_agent(backend, xid_sources=[("kmsg", kmsg)])
    agent.start(serve=False)
    agent.poll_once()
    # The kernel log names the GPU by bus id only (short form), the NVML event set by index.
    kmsg.events.append(XidEvent(node="node0", pci_bus_id="0000:11:00.0", code=48,
                                time=clock.now, source="kmsg"))
    backend.queue_xid(48, gpu=1, time=clock.now + 0.5)
    kmsg.events.append(XidEvent(node="node0", pci_bus_id="ff:00.0", code=13, time=clock.now,
                                source="kmsg"))
    poll = agent.poll_once()
    assert sorted((x.gpu, x.code) for x in poll.xids if x.code == 48) == [(1, 48)]
    unmapped = [x for x in poll.xids if x.code == 13]
    assert unmapped and unmapped[0].gpu is None
    counts = agent.exporter.snapshot.xid_counts
    assert counts[("1", 48, "memory")] == 1 and counts[("", 13, "application")] == 1
    # A failing XID source is marked down, the agent keeps polling.
    kmsg.fail = True
    agent.poll_once()
    assert agent.exporter.snapshot.xid_sources[0].up is False
    agent.stop()


def test_submitted_findings_join_table_and_next_poll() -> None:
    agent, clock = make_agent()
    agent.start(serve=False)
    agent.poll_once()
    hang = Finding(check="rank_hang", health=Health.UNHEALTHY,
                   subject=Subject(kind="rank", job="j1", rank=3), reason="no step for 9 s",
                   action=SuggestedAction.RESTART_JOB, time=clock.now)
    agent.submit_findings([hang], check="rank_hang")
    assert hang in agent.current_findings()
    assert agent.current_findings()[0] == hang  # worst first
    poll = agent.poll_once()
    assert [t.finding for t in poll.transitions] == [hang]
    # The check's complete judgement no longer lists the rank: it is dropped (-> unknown).
    agent.submit_findings([], check="rank_hang")
    assert hang not in agent.current_findings()
    (t,) = agent.poll_once().transitions
    assert t.previous == Health.UNHEALTHY and t.finding.health == Health.UNKNOWN
    agent.stop()


def test_run_ticks_on_a_grid_and_stops() -> None:
    """Real clocks: the loop polls every interval and stops promptly when told."""
    config = AgentConfig(node="node0", listen="127.0.0.1:0", kmsg=False, interval_s=0.05)
    agent = Agent(config, ScriptedBackend(quiet), checks=[XidCheck()])
    rec = Recorder()
    agent.add_component(rec)
    agent.start(serve=False)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 10
    while len(rec.polls) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    thread.join(timeout=5)
    agent.stop()
    assert not thread.is_alive()
    assert len(rec.polls) >= 5
    gaps = [b.time - a.time for a, b in itertools.pairwise(rec.polls)]
    # On a grid: the mean gap is the interval (generous bounds: a shared 2-core machine).
    assert 0.03 <= sum(gaps) / len(gaps) <= 0.5


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_http_endpoints() -> None:
    backend = ScriptedBackend(quiet, gpus=2)
    agent, clock = make_agent(backend)
    agent.start()
    try:
        assert agent.address is not None
        base = "http://{}:{}".format(*agent.address)
        status, body = _get(base + "/healthz")
        assert status == 503 and "no poll" in body
        backend.queue_xid(79, gpu=0, time=clock.now)
        agent.poll_once()
        assert _get(base + "/healthz")[0] == 200
        status, body = _get(base + "/metrics")
        assert status == 200
        assert 'forewarn_gpu_health{gpu="0",node="node0",simulated="true"' in body
        assert 'forewarn_agent_build_info{' in body
        status, body = _get(base + "/api/v1/findings")
        findings = json.loads(body)
        assert findings[0]["health"] == "unhealthy" and findings[0]["subject"]["gpu"] == 0
        assert findings[0]["action"] == "reboot"
        assert _get(base + "/nope")[0] == 404
        # Stale polls turn /healthz red.
        agent._test_mono.advance(60)  # type: ignore[attr-defined]
        assert _get(base + "/healthz")[0] == 503
    finally:
        agent.stop()


def test_scrape_does_not_touch_the_backend() -> None:
    backend = ScriptedBackend(quiet)
    agent, _ = make_agent(backend)
    agent.start()
    try:
        agent.poll_once()
        before = backend.samples_taken
        assert agent.address is not None
        base = "http://{}:{}".format(*agent.address)
        for _ in range(3):
            assert _get(base + "/metrics")[0] == 200
        assert backend.samples_taken == before
    finally:
        agent.stop()


def test_components_can_register_collectors() -> None:
    from prometheus_client.metrics_core import GaugeMetricFamily

    @dataclasses.dataclass(eq=False)
    class RankCollector(ComponentBase):
        name: str = "ranks"

        def start(self, agent: AgentHost) -> None:
            agent.registry.register(self)

        def describe(self) -> list[Any]:
            return []

        def collect(self) -> Any:
            g = GaugeMetricFamily("forewarn_rank_test", "test", labels=["job"])
            g.add_metric(["j"], 1)
            yield g

    from prometheus_client import generate_latest

    agent, _ = make_agent()
    agent.add_component(RankCollector())
    agent.start(serve=False)
    agent.poll_once()
    text = generate_latest(agent.registry).decode()
    assert 'forewarn_rank_test{job="j"} 1.0' in text and "forewarn_gpu_health" in text
    agent.stop()


def test_unreadable_kmsg_is_a_warning_not_an_error(tmp_path: Any, caplog: Any) -> None:
    from forewarn.agent.build import build_xid_sources

    config = AgentConfig(node="n", source="nvml", kmsg_path=tmp_path / "no-kmsg")
    assert build_xid_sources(config) == []
    assert "continuing without the kernel log" in caplog.text
    assert build_xid_sources(AgentConfig(node="n", kmsg=False)) == []
    # Simulated and replayed nodes have no kernel log of theirs to read.
    assert build_xid_sources(AgentConfig(node="n", source="sim")) == []


def test_build_backend_errors_name_the_problem(tmp_path: Any) -> None:
    from forewarn.agent.backend import SourceUnavailable
    from forewarn.agent.build import build_backend
    from forewarn.config import ConfigError

    with pytest.raises(ConfigError, match="replay_path"):
        build_backend(AgentConfig(node="n", source="replay"))
    bad = tmp_path / "scenario.toml"
    bad.write_text("gpus = 'many'\n")
    with pytest.raises(SourceUnavailable, match=str(bad)):
        build_backend(AgentConfig(node="n", source="sim", scenario=bad))
    sim = build_backend(AgentConfig(node="n", source="sim", sim_gpus=3))
    assert sim.name == "sim" and sim.simulated
