"""An order's commands and its ``actions`` row are written in ONE transaction (issue 16):
no reader, and no next leader, sees the commands of a checkpoint order or a save hold
without the action that says which decision issued them, or the reverse. A crash
injected as the action row is written leaves neither. On SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import pytest

from forewarn.collector.decide.actions import ActionPipeline
from forewarn.collector.decide.orders import OrderBook
from forewarn.collector.decide.policy import Policy, PolicySettings
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.state import StateStore, Transaction
from forewarn.wire import Finding, Health, Subject, SuggestedAction

from support.policy import T0, Clock, fleet, gpu_finding


class Crash(RuntimeError):
    """The process died here."""


class DiesWritingAnAction:
    """The real transaction, but the process dies at the statement that stores an
    action (nothing after it is written)."""

    def __init__(self, conn: Transaction) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        if sql.lstrip().startswith("INSERT INTO actions"):
            raise Crash(sql)
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> Any:
        return self._conn.executemany(sql, params)


class CrashingStore:
    """``store`` whose every write of an ``actions`` row dies (see above)."""

    def __init__(self, store: StateStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    @contextlib.contextmanager
    def write(self, *, lead: bool = False) -> Iterator[Transaction]:
        with self._store.write(lead=lead) as conn:
            yield DiesWritingAnAction(conn)

    def record_action(self, **_kw: Any) -> int:
        raise Crash("record_action")


NAN = Finding(check="nan_loss", health=Health.UNHEALTHY, action=SuggestedAction.RESTART_JOB,
              subject=Subject(kind="rank", node="n1", job="job1", rank=0), time=T0,
              reason="loss is NaN", evidence={"bad_step": 480})


@pytest.mark.parametrize(("finding", "kind"), [(gpu_finding("n0"), "checkpoint"),
                                               (NAN, "hold")])
def test_a_crash_writing_the_action_leaves_no_command_without_it(
        backend_state: StateStore, finding: Finding, kind: str) -> None:
    store, clock = cast(StateStore, CrashingStore(backend_state)), Clock()
    policy = Policy(PolicySettings(), fleet(), clock=clock)
    orders = OrderBook(CommandQueue(store, CollectorMetrics()), clock=clock)
    ActionPipeline(policy, orders, actions=store).handle_findings([finding])
    commands = backend_state.scalar("SELECT count(*) FROM commands WHERE kind = ?", (kind,))
    actions = backend_state.scalar("SELECT count(*) FROM actions WHERE kind = ?", (kind,))
    assert (commands, actions) == (0, 0)


def test_an_order_and_its_action_are_stored_together(backend_state: StateStore) -> None:
    store, clock = backend_state, Clock()
    policy = Policy(PolicySettings(), fleet(), clock=clock)
    orders = OrderBook(CommandQueue(store, CollectorMetrics()), clock=clock)
    ActionPipeline(policy, orders, actions=store).handle_findings([gpu_finding("n0"), NAN])
    for kind in ("checkpoint", "hold"):
        [row] = store.query("SELECT status, detail FROM actions WHERE kind = ?", (kind,))
        assert row["status"] == "ordered"
        ids = {r["id"].rsplit("@", 1)[0]
               for r in store.query("SELECT id FROM commands WHERE kind = ?", (kind,))}
        assert len(ids) == 1 and ids.pop() in row["detail"]
