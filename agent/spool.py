"""The uplink's write-ahead spool: sealed batches on disk, one file each, replayed in order.

Every sealed batch is written to the spool directory (one file per batch named by its
``seq``, fsync'd, renamed into place) *before* it is sent, and deleted only when the
collector stored it; urgent batches jump the queue. Above ``max_bytes`` the oldest batches
are dropped and counted, except a batch *in doubt* (sent, and the collector may have stored
it without the answer arriving, :meth:`Spool.in_doubt`): it stays until it is answered, so
a batch counted as dropped is one the collector never got. A batch refused for good is
moved to ``rejected/`` with the answer beside it. ``agent_id``, the next ``seq`` and the
batches in doubt live in ``state.json`` (an agent restarted before the answer keeps them).
See :mod:`forewarn.agent.uplink` for how the uplink uses it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forewarn.files import fsync_dir, write_atomic
from forewarn.wire import AgentBatch, encode

__all__ = ["Spool"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{20})\.(u|n)\.msgpack$")


class Spool:
    """Sealed batches on disk, one file each, oldest first; see the module docstring.

    Not thread-safe by itself: the uplink's push thread is its only user.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dropped = 0
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        self._files: dict[int, tuple[Path, int, bool]] = {}
        for path in self.root.iterdir():
            m = _NAME.match(path.name)
            if m:
                self._files[int(m.group(1))] = (path, path.stat().st_size, m.group(2) == "u")
        state = self._read_state()
        self.agent_id: str = state.get("agent_id") or f"{uuid.uuid4().hex}"
        self.next_seq: int = max([int(state.get("next_seq", 0)),
                                  *(s + 1 for s in self._files)])
        self._in_doubt: set[int] = set(state["in_doubt"]) & self._files.keys()
        self._write_state()

    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.root / "state.json").read_text())
        except (OSError, ValueError):
            return {"in_doubt": []}
        if not isinstance(data, dict):
            return {"in_doubt": []}
        ok_id = isinstance(data.get("agent_id"), str) and 0 < len(data["agent_id"]) <= 256
        ok_seq = isinstance(data.get("next_seq"), int) and data["next_seq"] >= 0
        doubt = data.get("in_doubt")
        return {"agent_id": data["agent_id"] if ok_id else None,
                "next_seq": data["next_seq"] if ok_seq else 0,
                "in_doubt": [s for s in doubt if isinstance(s, int)]
                if isinstance(doubt, list) else []}

    def _write_state(self) -> None:
        write_atomic(self.root / "state.json",
                      json.dumps({"agent_id": self.agent_id, "next_seq": self.next_seq,
                                  "in_doubt": sorted(self._in_doubt)}).encode())
        fsync_dir(self.root)

    @property
    def bytes(self) -> int:
        return sum(size for _p, size, _u in self._files.values())

    def __len__(self) -> int:
        return len(self._files)

    def append(self, make: Callable[[str, int], AgentBatch]) -> AgentBatch:
        """Seal ``make(agent_id, seq)`` under the next seq: durable when this returns."""
        seq = self.next_seq
        batch = make(self.agent_id, seq)
        data = encode(batch)
        path = self.root / f"{seq:020d}.{'u' if batch.urgent else 'n'}.msgpack"
        write_atomic(path, data)
        self.next_seq = seq + 1
        self._write_state()
        self._files[seq] = (path, len(data), batch.urgent)
        self._enforce_bound()
        return batch

    def _enforce_bound(self) -> None:
        total = self.bytes
        # Keep at least the newest batch, even when it alone is over the bound.
        for seq in sorted(self._files)[:-1]:
            if total <= self.max_bytes:
                break
            if seq in self._in_doubt:
                continue
            total -= self._files[seq][1]
            self.remove(seq)
            self.dropped += 1
            log.warning("spool over %d bytes: dropped batch seq %d", self.max_bytes, seq)

    def pending(self) -> list[tuple[int, Path]]:
        """Batches to send: urgent ones first, each group in seq order."""
        order = sorted(self._files, key=lambda s: (not self._files[s][2], s))
        return [(s, self._files[s][0]) for s in order]

    def urgent(self, seq: int) -> bool:
        """Whether spooled batch ``seq`` is urgent (False when it is not spooled)."""
        entry = self._files.get(seq)
        return entry is not None and entry[2]

    def in_doubt(self, seq: int) -> None:
        """Batch ``seq`` was sent and may be stored (no answer came back, or a server
        error): the bound must not drop it, or it would count as dropped a batch the
        collector has. It stays in doubt until it leaves the spool (sent again and
        answered ``stored``/``duplicate``, or refused for good)."""
        if seq in self._files and seq not in self._in_doubt:
            self._in_doubt.add(seq)
            self._write_state()

    def remove(self, seq: int) -> None:
        self._in_doubt.discard(seq)
        entry = self._files.pop(seq, None)
        if entry is not None:
            entry[0].unlink(missing_ok=True)

    def reject(self, seq: int, why: str) -> Path | None:
        """Move batch ``seq`` to ``rejected/`` with ``why`` beside it, out of the queue;
        ``rejected/`` keeps at most ``max_bytes`` (oldest dropped). Returns where it went."""
        self._in_doubt.discard(seq)
        entry = self._files.pop(seq, None)
        if entry is None:
            return None
        folder = self.root / "rejected"
        target = folder / entry[0].name
        try:
            folder.mkdir(exist_ok=True, mode=0o700)
            os.replace(entry[0], target)
            write_atomic(target.with_suffix(".txt"), why.encode())
        except OSError as exc:
            log.error("uplink: cannot move batch %d aside (%s); deleting it", seq, exc)
            entry[0].unlink(missing_ok=True)
            return None
        kept = sorted(folder.iterdir())
        total = sum(p.stat().st_size for p in kept)
        for old in kept:
            if total <= self.max_bytes or old == target or old == target.with_suffix(".txt"):
                continue
            total -= old.stat().st_size
            old.unlink(missing_ok=True)
        return target
