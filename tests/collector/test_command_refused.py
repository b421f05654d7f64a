"""A command that cannot be queued (no node, an empty node, a kind agents do not know) is
refused before the insert, with an error naming the field, counted, and nothing of its
batch stored: the same on SQLite and PostgreSQL. Before, SQLite's ``INSERT OR IGNORE``
also ignored the NOT NULL violation (the command silently dropped, ``enqueue_many``
answering 0) while PostgreSQL's ``ON CONFLICT DO NOTHING`` raised. A policy plugin can hand
such an item back (a :class:`NodeCommand` is not validated when built)."""

from __future__ import annotations

from typing import Any

import pytest

from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue, NodeCommand
from forewarn.collector.storage.state import StateStore
from forewarn.wire import Command

from support.policy import T0


def _probe(node: Any, *, id: str = "probe-1", kind: Any = "probe") -> NodeCommand:
    return NodeCommand(node=node, command=Command(id=f"{id}@{node}", kind=kind, issued=T0))


@pytest.mark.parametrize(("item", "field"), [
    (_probe(None), "$.node"),
    (_probe(""), "$.node"),
    (_probe("n2", kind=None), "$.command.kind"),
    (_probe("n2", kind="reboot"), "$.command.kind"),
], ids=["node None", "node empty", "kind None", "kind unknown"])
def test_a_command_that_cannot_be_queued_is_refused_naming_the_field(
        backend_state: StateStore, item: NodeCommand, field: str) -> None:
    metrics = CollectorMetrics()
    queue = CommandQueue(backend_state, metrics, clock=lambda: T0)
    with pytest.raises(ValueError, match=rf"{item.command.id!r}.*{field.replace('$', '[$]')}"):
        queue.enqueue_many([_probe("n1"), item])
    assert backend_state.scalar("SELECT count(*) FROM commands") == 0  # the batch refused
    assert metrics.registry.get_sample_value(
        "forewarn_collector_commands_total", {"kind": "invalid", "event": "refused"}) == 1


def test_a_command_queued_again_is_ignored_by_its_id(backend_state: StateStore) -> None:
    """The one conflict the insert leaves alone: the same command id queued twice."""
    queue = CommandQueue(backend_state, CollectorMetrics(), clock=lambda: T0)
    assert queue.enqueue_many([_probe("n1")]) == 1
    assert queue.enqueue_many([_probe("n1"), _probe("n2")]) == 1
    assert backend_state.scalar("SELECT count(*) FROM commands") == 2
