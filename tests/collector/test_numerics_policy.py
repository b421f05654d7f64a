"""Bad numerics at the collector: a NaN loss (and a grad-norm spike when configured) makes
the policy hold the job's saves on every node of the job (a ``hold`` command carrying the
onset and the step the ranks stop at), and the job view shows the last good step.

A real collector over real HTTP on loopback with its SQLite store (tests/support/collector)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from forewarn.wire import CheckpointReport, Finding, Health, SaveHold, Subject, SuggestedAction

from support.collector import Service, ranks_on, start_service, stop_service
from support.polling import wait_for


def _numerics_finding(check: str, rank: int, node: str, bad_step: int) -> Finding:
    action = SuggestedAction.RESTART_JOB if check == "nan_loss" else SuggestedAction.CHECKPOINT
    return Finding(check=check, health=Health.UNHEALTHY,
                   subject=Subject(kind="rank", node=node, gpu=rank % 2, job="train-1",
                                   rank=rank),
                   reason=f"rank {rank} of job train-1: {check} since step {bad_step}",
                   action=action, evidence={"bad_step": bad_step, "step": bad_step + 3},
                   time=time.time())


def _service(tmp_path: Path, **overrides: Any) -> Service:
    s = start_service(tmp_path, **overrides)
    now = time.time()
    s.push("node1", ranks=ranks_on("node1", 0, now))
    s.push("node2", ranks=ranks_on("node2", 2, now))
    return s


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = _service(tmp_path)
    yield s
    stop_service(s)


def _commands(svc: Service, node: str, wait: float = 25.0) -> list[dict[str, Any]]:
    """What the node's agent gets (the policy acts on its own thread: a long poll)."""
    return svc.commands(node, wait=wait)


def _numerics(svc: Service) -> dict[str, Any]:
    """The job view's bad numerics, once the policy recorded its hold."""
    got: dict[str, Any] = wait_for(
        lambda: svc.client.get("/api/v1/jobs/train-1").json()["numerics"], 10, "the hold")
    return got


def _holds(cmds: list[dict[str, Any]]) -> list[SaveHold]:
    return [msgspec.convert(c["hold"], SaveHold) for c in cmds if c["kind"] == "hold"]


def test_nan_loss_holds_saves_on_every_node_of_the_job_and_the_job_shows_the_last_good_step(
        svc: Service) -> None:
    svc.push("node1", findings=[_numerics_finding("nan_loss", 1, "node1", 480)])
    cmds = {node: _commands(svc, node) for node in ("node1", "node2")}
    assert [c["kind"] for c in cmds["node1"]] == ["hold"]  # no ordered save of the poison
    (h1,), (h2,) = _holds(cmds["node1"]), _holds(cmds["node2"])
    assert h1 == h2  # one hold, the same step for every rank of the job
    assert h1.job == "train-1" and h1.onset_step == 480
    # ahead of the furthest rank (step 500 reported at 0.2 s a step)
    assert h1.step > 500

    numerics = _numerics(svc)
    assert numerics["onset_step"] == 480 and numerics["held_from_step"] == h1.step
    assert numerics["last_good_step"] == 100  # the ranks' checkpoint before the onset


def test_grad_spike_holds_saves_only_when_configured(tmp_path: Path) -> None:
    default = _service(tmp_path / "default")
    try:
        default.push("node1", findings=[_numerics_finding("grad_spike", 0, "node1", 450)])
        # the default: a spike's newest finite state is worth saving (an order, no hold)
        assert [c["kind"] for c in _commands(default, "node1")] == ["checkpoint"]
        assert default.client.get("/api/v1/jobs/train-1").json()["numerics"] is None
    finally:
        stop_service(default)
    held = _service(tmp_path / "held", policy_hold_checks=("nan_loss", "grad_spike"))
    try:
        held.push("node1", findings=[_numerics_finding("grad_spike", 0, "node1", 450)])
        (h,) = _holds(_commands(held, "node2"))
        assert h.onset_step == 450
        assert _numerics(held)["last_good_step"] == 100
    finally:
        stop_service(held)


def test_shadow_mode_records_the_hold_and_sends_nothing(tmp_path: Path) -> None:
    s = _service(tmp_path, policy_shadow=True)
    try:
        s.push("node1", findings=[_numerics_finding("nan_loss", 0, "node1", 490)])
        numerics = _numerics(s)
        assert not _commands(s, "node1", wait=0) and not _commands(s, "node2", wait=0)
        assert numerics["onset_step"] == 490 and numerics["held_from_step"] is None
    finally:
        stop_service(s)


def test_a_rank_past_the_holds_step_reports_missed_and_every_node_gets_it_again(
        svc: Service) -> None:
    """The hold is issued again from the step after the one the rank reported (the last it
    passed unheld), replacing the missed one on every node of the job: not further ahead,
    which would free steps no rank has reached for the ranks it reached first (issue 15,
    :func:`forewarn.ordering.reissued_hold`)."""
    svc.push("node1", findings=[_numerics_finding("nan_loss", 1, "node1", 480)])
    (first,) = _holds(_commands(svc, "node1"))
    assert _holds(_commands(svc, "node2")) == [first]
    late = first.step + 40  # rank 3 was there already when the hold reached it
    svc.push("node2", checkpoints=[CheckpointReport(
        job="train-1", rank=3, host="node2", request_id=first.request_id, step=late,
        phase="missed", time=time.time())])
    again = {node: _holds(_commands(svc, node)) for node in ("node1", "node2")}
    assert again["node1"] == again["node2"] and len(again["node1"]) == 1, again
    (second,) = again["node1"]
    assert second.replaces == first.request_id and second.request_id != first.request_id
    assert second.step == late + 1 and second.onset_step == 480
    wait_for(lambda: _numerics(svc)["held_from_step"] == second.step, 10, "the re-issue")
