"""The agent reads ``net.unix.max_dgram_qlen`` when it creates its socket (the kernel fixes
the socket's queue limit then): below the recommended value it logs one warning naming the
sysctl and the file ``forewarn deploy install`` writes, and it shows the value on
``/metrics`` and in ``/readyz``. A real agent with the rank component, its HTTP server on
loopback; the value comes from a file the test writes instead of ``/proc``."""

from __future__ import annotations

import json
import logging
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.agent.config import AgentConfig
from forewarn.agent.daemon import Agent
from forewarn.agent.rank_component import RankComponent
from forewarn.agent.testing import ScriptedBackend

GAUGE = "forewarn_agent_socket_max_dgram_qlen"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def _gauge(body: str) -> float:
    (line,) = [x for x in body.splitlines() if x.startswith(GAUGE + " ")]
    return float(line.split()[1])


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Any]:
    """``start(qlen_text)``: a running agent whose ``max_dgram_qlen`` file holds
    ``qlen_text`` (None: no such file); returns (base URL, /readyz rank_socket part)."""
    agents: list[Agent] = []

    def start(qlen_text: str | None) -> tuple[str, dict[str, Any]]:
        qlen = tmp_path / "max_dgram_qlen"
        if qlen_text is not None:
            qlen.write_text(qlen_text)
        config = AgentConfig(node="n0", listen="127.0.0.1:0", kmsg=False,
                             socket_path=tmp_path / "run" / "agent.sock")
        agent = Agent(config, ScriptedBackend(lambda gpu, t: {"temperature_c": 40.0}))
        agent.add_component(RankComponent(config, qlen_path=qlen))
        agents.append(agent)
        agent.start()
        assert agent.address is not None
        base = "http://{}:{}".format(*agent.address)
        agent.poll_once()
        ready = json.loads(_get(base + "/readyz"))
        return base, ready["components"]["rank_socket"]

    yield start
    for agent in agents:
        agent.stop()


def test_a_low_limit_is_warned_about_once_and_shown(
        start_agent: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="forewarn.agent"):
        base, part = start_agent("10\n")
    warnings = [r.getMessage() for r in caplog.records
                if "net.unix.max_dgram_qlen" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "= 10" in warnings[0] and "/etc/sysctl.d/60-forewarn.conf" in warnings[0]
    assert _gauge(_get(base + "/metrics")) == 10
    # shown, but the socket works: still ready
    assert part["ready"] is True and part["max_dgram_qlen"] == 10
    assert "net.unix.max_dgram_qlen = 10, below 512" in part["detail"]


def test_the_recommended_limit_gives_no_warning(
        start_agent: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="forewarn.agent"):
        base, part = start_agent("512\n")
    assert "max_dgram_qlen" not in caplog.text
    assert _gauge(_get(base + "/metrics")) == 512
    assert part["max_dgram_qlen"] == 512 and "below" not in part["detail"]


def test_an_unreadable_limit_is_unknown_not_fatal(
        start_agent: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="forewarn.agent"):
        base, part = start_agent(None)
    assert "max_dgram_qlen" in caplog.text and "not known" in caplog.text
    assert math.isnan(_gauge(_get(base + "/metrics")))
    assert part["ready"] is True and part["max_dgram_qlen"] is None
