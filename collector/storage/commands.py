"""Per-node command queues: persisted in SQLite, delivered over a long poll, acknowledged.

Agents hold ``GET /api/v1/commands?node=N&wait=25`` open (no inbound port on nodes). A
command stays pending until the agent acknowledges it; one delivered but not acknowledged
within ``redeliver_s`` is delivered again (at-least-once: agents deduplicate by id), and
one older than ``ttl_s`` is no longer delivered. Because the queue lives in the database,
a collector restart keeps every pending order.

:meth:`CommandQueue.enqueue` is thread-safe and may be called from the policy's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from forewarn.wire import CheckpointOrder, Command, CommandAck, SaveHold, decode, encode
from forewarn.wire.base import Name

from ..metrics import CollectorMetrics
from .state import StateStore, insert_action

__all__ = ["CommandQueue", "NodeCommand"]


class NodeCommand(msgspec.Struct, frozen=True, kw_only=True):
    """A command addressed to one node's agent (what the policy hands back). Not validated
    when built: :class:`CommandQueue` refuses one whose fields the agent could not take."""

    node: Name
    command: Command


class CommandQueue:
    """Pending commands per node, with long-poll wake-ups. See the module docstring."""

    def __init__(
        self,
        store: StateStore,
        metrics: CollectorMetrics,
        *,
        redeliver_s: float = 30.0,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.redeliver_s = redeliver_s
        self.ttl_s = ttl_s
        self.clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._closing = False
        self.on_enqueue: Callable[[str], None] | None = None
        """Called with the node after a new command is queued (any thread): the NATS bus
        (:mod:`forewarn.collector.ingest.bus`) publishes it at once."""
        self._refresh_pending()
        store.watch_commands(self._wake)  # commands queued by another replica

    def bind_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Tell the queue which event loop runs the long polls (set at app start-up)."""
        self._loop = loop

    def release_polls(self) -> None:
        """The server is stopping: every open long poll answers now (with what is due,
        usually nothing) instead of holding its connection until ``wait`` runs out. Call
        on the event loop."""
        self._closing = True
        for event in self._events.values():
            event.set()

    # -- producing ------------------------------------------------------------------------

    def enqueue_many(self, items: Iterable[NodeCommand]) -> int:
        """Queue several commands in one transaction; returns how many were new."""
        return len(self._insert(list(items)))

    def _insert(self, items: list[NodeCommand], action: dict[str, Any] | None = None
                ) -> list[NodeCommand]:
        """Queue ``items`` in ONE transaction (one turn at the store's write lock for a
        whole decision, and a publisher woken for the first node finds them all), with
        ``action`` (:func:`~.state.insert_action`'s keywords: the row that says which
        decision issued them) in it too, so no reader sees one without the other; returns
        the items that were new."""
        if not items and action is None:
            return []
        for item in items:
            self._check(item)
        now = self.clock()
        added = []
        # Only the leader queues commands: a replica that lost the lead and has not noticed
        # yet is refused here (NotLeaderError), nothing stored (storage/fence.py).
        with self.store.write(lead=True) as conn:
            for item in items:
                c = item.command
                # Only a command queued again (its id) is ignored: any other constraint
                # raises, on SQLite as on PostgreSQL (OR IGNORE would skip NOT NULL too).
                cur = conn.execute(
                    "INSERT INTO commands (id, node, kind, body, created, expires)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                    (c.id, item.node, c.kind, encode(c), now, now + self.ttl_s))
                if cur.rowcount == 1:
                    added.append(item)
            if action is not None:
                insert_action(conn, **action)
        if added:
            for item in added:
                self.metrics.commands.labels(item.command.kind, "queued").inc()
            self._refresh_pending()
            for node in dict.fromkeys(item.node for item in added):
                self._wake(node)
                if self.on_enqueue is not None:
                    self.on_enqueue(node)
        return added

    def _check(self, item: NodeCommand) -> None:
        """Refuse ``item`` (counted; ValueError naming the command and the field) unless
        the agent could take it: a node (:data:`~forewarn.wire.base.Name`) and a command
        that decodes as :class:`~forewarn.wire.Command`. Nothing of the batch is queued."""
        try:
            msgspec.convert(msgspec.to_builtins(item), NodeCommand)
        except (msgspec.ValidationError, TypeError) as e:
            self.metrics.commands.labels("invalid", "refused").inc()
            command_id = getattr(item.command, "id", None)
            raise ValueError(f"command {command_id!r} refused: {e}") from e

    def order_checkpoint(self, nodes: Iterable[str], order: CheckpointOrder,
                         action: dict[str, Any] | None = None) -> list[NodeCommand]:
        """Send ``order`` to every node in ``nodes`` (one command each, id
        ``<request_id>@<node>``), its ``action`` row in the same transaction; returns the
        commands queued."""
        return self._to_nodes(nodes, order.request_id, order.issued, "checkpoint", action,
                              order=order)

    def hold_saves(self, nodes: Iterable[str], hold: SaveHold,
                   action: dict[str, Any] | None = None) -> list[NodeCommand]:
        """Send ``hold`` to every node in ``nodes`` (one command each, id
        ``<request_id>@<node>``), its ``action`` row in the same transaction; returns the
        commands queued."""
        return self._to_nodes(nodes, hold.request_id, hold.issued, "hold", action, hold=hold)

    def _to_nodes(self, nodes: Iterable[str], request_id: str, issued: float, kind: str,
                  action: dict[str, Any] | None, **payload: Any) -> list[NodeCommand]:
        return self._insert([
            NodeCommand(node=node, command=Command(id=f"{request_id}@{node}"[:128], kind=kind,
                                                   issued=issued, **payload))
            for node in sorted(set(nodes))], action)

    def _wake(self, node: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop shutting down
            loop.call_soon_threadsafe(self._set_event, node)

    def _set_event(self, node: str) -> None:
        event = self._events.get(node)
        if event is not None:
            event.set()

    # -- consuming ------------------------------------------------------------------------

    def due_nodes(self) -> list[str]:
        """Nodes with commands due for delivery now (new, or delivered but unacknowledged
        for ``redeliver_s``)."""
        now = self.clock()
        rows = self.store.query(
            "SELECT DISTINCT node FROM commands WHERE acked_at IS NULL AND expires > ?"
            " AND (delivered_at IS NULL OR delivered_at < ?)", (now, now - self.redeliver_s))
        return [str(r["node"]) for r in rows]

    def take(self, node: str) -> list[Command]:
        """Commands due for delivery to ``node`` now; marks them delivered."""
        return self.take_many([node]).get(node, [])

    def take_many(self, nodes: Iterable[str]) -> dict[str, list[Command]]:
        """Commands due for delivery now to each of ``nodes`` (those with none left out),
        marked delivered in ONE transaction: the bus publisher takes a decision's commands
        for all its nodes in one turn at the store's write lock."""
        now = self.clock()
        wanted = sorted(set(nodes))
        due_where = ("acked_at IS NULL AND expires > ?"
                     " AND (delivered_at IS NULL OR delivered_at < ?)")
        # Most polls find nothing: ask the read connection first, so an idle fleet's long
        # polls never take the write lock (nor cost an fsync).
        due = [n for n in wanted if self.store.scalar(
            f"SELECT 1 FROM commands WHERE node = ? AND {due_where} LIMIT 1",
            (n, now, now - self.redeliver_s)) is not None]
        if not due:
            return {}
        out: dict[str, list[Command]] = {}
        with self.store.write() as conn:
            for node in due:
                rows = conn.execute(
                    f"SELECT id, body FROM commands WHERE node = ? AND {due_where}"
                    " ORDER BY created, id", (node, now, now - self.redeliver_s)).fetchall()
                if rows:
                    conn.executemany(
                        "UPDATE commands SET delivered_at = ?, deliveries = deliveries + 1"
                        " WHERE id = ?", [(now, r["id"]) for r in rows])
                    out[node] = [decode(bytes(r["body"]), Command) for r in rows]
        for commands in out.values():
            for c in commands:
                self.metrics.commands.labels(c.kind, "delivered").inc()
        return out

    async def poll(self, node: str, wait_s: float) -> list[Command]:
        """Long poll: return as soon as ``node`` has commands, or ``[]`` after ``wait_s``."""
        deadline = time.monotonic() + max(0.0, wait_s)
        event = self._events.setdefault(node, asyncio.Event())
        self.metrics.long_polls.inc()
        try:
            while True:
                event.clear()
                commands = await asyncio.to_thread(self.take, node)
                if commands or self._closing:
                    return commands
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                # Wake on enqueue, or in time for a redelivery that falls due meanwhile.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(remaining, self.redeliver_s))
        finally:
            self.metrics.long_polls.dec()

    def ack(self, ack: CommandAck, node: str) -> str:
        """Record ``ack`` from ``node``'s agent. Returns ``acked``, ``already`` or
        ``unknown`` (no such command for that node)."""
        with self.store.write() as conn:
            row = conn.execute("SELECT kind, acked_at FROM commands WHERE id = ? AND node = ?",
                               (ack.id, node)).fetchone()
            if row is None:
                return "unknown"
            if row["acked_at"] is not None:
                return "already"
            conn.execute("UPDATE commands SET acked_at = ?, ok = ?, detail = ? WHERE id = ?",
                         (self.clock(), int(ack.ok), ack.detail, ack.id))
        self.metrics.commands.labels(row["kind"], "acked" if ack.ok else "failed").inc()
        self._refresh_pending()
        return "acked"

    def list(self, *, node: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
        """Commands, newest first, with their delivery and acknowledgement state."""
        sql = ("SELECT id, node, kind, body, created, expires, delivered_at, deliveries,"
               " acked_at, ok, detail FROM commands")
        params: list[Any] = []
        if node is not None:
            sql += " WHERE node = ?"
            params.append(node)
        sql += " ORDER BY created DESC LIMIT ?"
        params.append(limit)
        rows = self.store.query(sql, params)
        for row in rows:
            row["command"] = msgspec.to_builtins(decode(bytes(row.pop("body")), Command))
        return rows

    def _refresh_pending(self) -> None:
        n = self.store.scalar("SELECT COUNT(*) FROM commands WHERE acked_at IS NULL AND"
                              " expires > ?", (self.clock(),))
        self.metrics.commands_pending.set(int(n or 0))
