"""``forewarn agent`` assembles its parts explicitly (agent/build.py): the uplink gets the
rank component's table and order book handed to it, instead of looking for a component
named "ranks" once it has started."""

from __future__ import annotations

import time
from pathlib import Path

from forewarn.agent.build import build_components
from forewarn.agent.config import AgentConfig
from forewarn.agent.rank_component import RankComponent
from forewarn.agent.uplink import Uplink
from forewarn.wire import CheckpointOrder, Command


def test_the_uplink_is_wired_to_the_rank_components_orders_before_anything_starts(
    tmp_path: Path,
) -> None:
    config = AgentConfig(node="n", collector_url="http://127.0.0.1:1", token="t",
                         spool_dir=tmp_path / "spool", socket_path=tmp_path / "agent.sock")
    ranks, uplink = build_components(config)
    assert isinstance(ranks, RankComponent) and isinstance(uplink, Uplink)
    # Not started: a collector's order reaches the real order book all the same (which
    # says the job has no rank here), not "no ranks component on this agent".
    order = CheckpointOrder(request_id="r1", job="j", step=7, issued=time.time())
    ok, detail = uplink.handle(Command(id="c1", kind="checkpoint", order=order,
                                       issued=time.time()))
    assert (ok, detail) == (True, "no live rank of job 'j' on this node: none known here")
    assert uplink.feed is ranks.table and uplink.orders is ranks.orders


def test_a_standalone_agent_has_only_the_rank_component(tmp_path: Path) -> None:
    config = AgentConfig(node="n", socket_path=tmp_path / "agent.sock")
    assert [type(c) for c in build_components(config)] == [RankComponent]
