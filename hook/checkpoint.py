"""A default checkpoint writer for users who have none.

Layout: ``<directory>/step-000000042/`` holding the state file(s) and ``manifest.json``
(step, format, and per file its size and sha256). A checkpoint becomes visible only
complete: everything is written into ``.tmp-step-000000042`` in the same directory, each
file is fsynced, the temp directory is fsynced and renamed, then the parent directory is
fsynced, so a crash leaves either the old set or the new one (plus a temp directory that
the next save removes). The newest ``keep_last`` checkpoints are kept.

Two formats:

* ``torch``: one ``state.pt`` by ``torch.save`` (one process, no process group).
* ``dcp``: when ``torch.distributed`` is initialised, :mod:`torch.distributed.checkpoint`
  writes one shard per rank (``async_save`` via :meth:`CheckpointWriter.save_async`);
  every rank must call ``save`` at the same step (which the checkpoint orders ensure).
  Rank 0 writes the manifest and renames.

:meth:`CheckpointWriter.load_latest` verifies the manifest and every sha256 and falls back
to the previous good checkpoint when the newest is corrupt, logging what it skipped and
why. Loading never unpickles arbitrary objects: ``torch.load(weights_only=True)``, and for
DCP a load planner whose ``load_bytes`` also uses ``weights_only=True`` (torch's default
planner uses ``weights_only=False`` there).

torch is imported lazily, on the first save or load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["CheckpointResult", "CheckpointWriter", "LoadedCheckpoint", "PendingCheckpoint"]

_log = logging.getLogger("forewarn.hook")

_STEP_DIR = re.compile(r"^step-(\d{9,})$")
MANIFEST = "manifest.json"
_FORMAT = "forewarn-checkpoint"


@dataclasses.dataclass(frozen=True)
class CheckpointResult:
    """What a save cost: pass ``seconds`` and ``bytes`` to ``Monitor.checkpoint_done``."""

    step: int
    path: str
    seconds: float
    bytes: int
    """Bytes this rank wrote (rank 0 includes the metadata and manifest)."""


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint and the state read from it."""

    step: int
    path: str
    state: dict[str, Any]
    skipped: tuple[tuple[str, str], ...] = ()
    """Newer checkpoints that failed verification: ``(path, reason)``."""


class PendingCheckpoint:
    """An asynchronous save in flight; :meth:`wait` returns its :class:`CheckpointResult`."""

    def __init__(self, finish: Callable[[], CheckpointResult]) -> None:
        self._finish = finish
        self._result: CheckpointResult | None = None

    def wait(self) -> CheckpointResult:
        """Block until written, manifested and renamed (idempotent)."""
        if self._result is None:
            self._result = self._finish()
        return self._result


def _step_name(step: int) -> str:
    return f"step-{step:09d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dist() -> Any:
    """``torch.distributed`` if a process group is initialised, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def _require_numpy() -> None:
    """torch.distributed.checkpoint saves with numpy: checked when the writer is built,
    where the user can act, not at the first ordered save, which would fail every rank."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError(
            "forewarn.hook.CheckpointWriter needs numpy (torch.distributed.checkpoint saves "
            "with it): pip install 'forewarn[hook]'", name="numpy") from None


class CheckpointWriter:
    """Atomic, verified, keep-last-N checkpoints (see module docstring).

    Args:
        directory: where checkpoints live (created if missing).
        keep_last: how many complete checkpoints to keep (>= 1).
        monitor: if given, each save reports itself with ``checkpoint_done``.
        clock: monotonic clock for durations (injectable).
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep_last: int = 3, *,
        monitor: Monitor | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        _require_numpy()
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.monitor = monitor
        self._clock = clock
        self._pending: PendingCheckpoint | None = None
        self._async_group: Any = None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any]) -> CheckpointResult:
        """Write ``state`` as the checkpoint of ``step`` and wait until it is durable."""
        return self._save(step, state, use_async=False).wait()

    def save_async(self, step: int, state: dict[str, Any]) -> PendingCheckpoint:
        """Like :meth:`save`, but with a process group the write runs in the background
        (``torch.distributed.checkpoint.async_save``): the state is staged to host
        memory now and written while training continues. Without a process group this
        is a synchronous save."""
        return self._save(step, state, use_async=True)

    def _save(self, step: int, state: dict[str, Any], use_async: bool) -> PendingCheckpoint:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._pending is not None:
            self._pending.wait()  # one save in flight at a time
            self._pending = None
        t0 = self._clock()
        self.directory.mkdir(parents=True, exist_ok=True)
        dist = _dist()
        rank = dist.get_rank() if dist is not None else 0
        tmp = self.directory / (".tmp-" + _step_name(step))
        if rank == 0:
            self._remove_stale_temps()
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        if dist is None:
            written = self._write_torch(tmp, state)
            result = self._finish(step, tmp, t0, "torch", written, 1)
            return PendingCheckpoint(lambda: result)
        dist.barrier()  # the temp directory exists (and is empty) for every rank
        return self._write_dcp(step, tmp, state, t0, use_async, dist)

    def _write_torch(self, tmp: Path, state: dict[str, Any]) -> list[str]:
        import torch

        path = tmp / "state.pt"
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return ["state.pt"]

    def _write_dcp(
        self, step: int, tmp: Path, state: dict[str, Any], t0: float, use_async: bool, dist: Any,
    ) -> PendingCheckpoint:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict_saver

        rank, world = dist.get_rank(), dist.get_world_size()
        if use_async and hasattr(dcp, "async_save"):
            if self._async_group is None:
                # background-thread collectives get their own gloo group, so they never
                # interleave with the training's collectives on the default group
                self._async_group = dist.new_group(backend="gloo")
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group)

            def finish() -> CheckpointResult:
                future.result()
                return self._finish_dcp(step, tmp, t0, rank, world, dist, barrier=False)

            self._pending = PendingCheckpoint(finish)
            return self._pending
        state_dict_saver.save(state, checkpoint_id=str(tmp))
        result = self._finish_dcp(step, tmp, t0, rank, world, dist, barrier=True)
        return PendingCheckpoint(lambda: result)

    def _finish_dcp(
        self, step: int, tmp: Path, t0: float, rank: int, world: int, dist: Any, barrier: bool,
    ) -> CheckpointResult:
        # every rank's files are complete once dcp.save returned on rank 0 (the
        # coordinator writes .metadata after gathering all ranks' write results)
        if rank == 0:
            files = sorted(p.name for p in tmp.iterdir() if p.is_file())
            result = self._finish(step, tmp, t0, "dcp", files, world)
        else:
            # FileSystemWriter names each rank's shard files __<rank>_<n>.distcp
            final = self.directory / _step_name(step)
            where = tmp if tmp.exists() else final  # rank 0 may have renamed it already
            nbytes = sum(
                (where / n).stat().st_size for n in os.listdir(where) if n.startswith(f"__{rank}_")
            )
            result = CheckpointResult(step, str(final), self._clock() - t0, nbytes)
        if barrier:
            dist.barrier()  # rank 0 has renamed: load_latest sees it on every rank
        if rank != 0:
            result = dataclasses.replace(result, seconds=self._clock() - t0)
        self._report(result)
        return result

    def _finish(
        self, step: int, tmp: Path, t0: float, kind: str, files: list[str], world: int,
    ) -> CheckpointResult:
        entries: dict[str, dict[str, Any]] = {}
        total = 0
        for name in files:
            p = tmp / name
            _fsync_file(p)
            size = p.stat().st_size
            total += size
            entries[name] = {"bytes": size, "sha256": _sha256(p)}
        manifest = {
            "format": _FORMAT, "version": 1, "step": step, "kind": kind,
            "world_size": world, "created": time.time(), "files": entries,
        }
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        with open(tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        total += len(data)
        _fsync_dir(tmp)
        final = self.directory / _step_name(step)
        trash = None
        if final.exists():  # the same step saved again (e.g. after a resume)
            trash = self.directory / (".old-" + _step_name(step))
            shutil.rmtree(trash, ignore_errors=True)
            final.rename(trash)
        tmp.rename(final)
        _fsync_dir(self.directory)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._prune()
        result = CheckpointResult(step, str(final), self._clock() - t0, total)
        if world == 1:
            self._report(result)
        return result

    def _report(self, result: CheckpointResult) -> None:
        if self.monitor is not None:
            self.monitor.checkpoint_done(result.step, result.seconds, result.bytes, result.path)

    def _remove_stale_temps(self) -> None:
        for p in self.directory.iterdir():
            if p.name.startswith((".tmp-step-", ".old-step-")) and p.is_dir():
                _log.info("forewarn: removing incomplete checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        """Wait for a save still in flight and release the background save's process
        group. Call before ``torch.distributed.destroy_process_group()``: a gloo group whose
        threads are still alive at interpreter exit aborts the process."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._async_group is not None:
            dist = _dist()
            if dist is not None:
                dist.destroy_process_group(self._async_group)
            self._async_group = None

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoint directories, oldest first (not verified)."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def _prune(self) -> None:
        for _, p in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def verify(self, path: str | os.PathLike[str]) -> str | None:
        """``None`` if the checkpoint at ``path`` is intact, else why it is not."""
        p = Path(path)
        try:
            manifest = json.loads((p / MANIFEST).read_bytes())
        except FileNotFoundError:
            return "manifest.json missing"
        except (OSError, ValueError) as exc:
            return f"manifest.json unreadable: {exc}"
        if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
            return "manifest.json is not a forewarn checkpoint manifest"
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "manifest.json lists no files"
        if manifest.get("kind") not in ("torch", "dcp"):
            return f"unknown checkpoint kind {manifest.get('kind')!r}"
        for name, entry in files.items():
            f = p / name
            if "/" in name or name.startswith(".."):
                return f"manifest names a file outside the checkpoint: {name!r}"
            if not f.is_file():
                return f"{name} missing"
            if not isinstance(entry, dict):
                return f"manifest entry for {name} is malformed"
            if f.stat().st_size != entry.get("bytes"):
                return f"{name} is {f.stat().st_size} bytes, manifest says {entry.get('bytes')}"
            if _sha256(f) != entry.get("sha256"):
                return f"{name} sha256 mismatch"
        return None

    def load_latest(self, state: dict[str, Any] | None = None) -> LoadedCheckpoint | None:
        """Load the newest intact checkpoint, or ``None`` if there is none.

        ``state``: for DCP checkpoints, the state dict to load into in place (its tensors
        give shapes and shardings); for ``torch`` checkpoints it is not needed. With a
        process group every rank must call this; they agree on the step (the smallest
        of the ranks' choices, should their verification differ).
        """
        skipped: list[tuple[str, str]] = []
        good: list[tuple[int, Path]] = []
        for step, p in reversed(self.checkpoints()):
            reason = self.verify(p)
            if reason is None:
                good.append((step, p))
                break
            _log.warning("forewarn: skipping checkpoint %s: %s", p, reason)
            skipped.append((str(p), reason))
        dist = _dist()
        chosen = good[0] if good else None
        if dist is not None:
            import torch

            t = torch.tensor([chosen[0] if chosen else -1], dtype=torch.int64)
            if dist.get_backend() == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            agreed = int(t.item())
            if agreed < 0:
                return None
            if chosen is None or chosen[0] != agreed:
                path = self.directory / _step_name(agreed)
                reason = self.verify(path)
                if reason is not None:
                    raise RuntimeError(f"ranks disagree on the checkpoint; {path}: {reason}")
                chosen = (agreed, path)
        if chosen is None:
            return None
        step, path = chosen
        kind = json.loads((path / MANIFEST).read_bytes())["kind"]
        loaded = self._load_dcp(path, state) if kind == "dcp" else self._load_torch(path)
        return LoadedCheckpoint(step=step, path=str(path), state=loaded, skipped=tuple(skipped))

    @staticmethod
    def _load_torch(path: Path) -> dict[str, Any]:
        import torch

        obj = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        if not isinstance(obj, dict):
            raise ValueError(f"{path}/state.pt holds {type(obj).__name__}, not a dict")
        return obj

    @staticmethod
    def _load_dcp(path: Path, state: dict[str, Any] | None) -> dict[str, Any]:
        import torch
        from torch.distributed.checkpoint import state_dict_loader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        if state is None:
            raise ValueError("loading a DCP checkpoint needs the state dict to load into")

        class _WeightsOnlyPlanner(DefaultLoadPlanner):
            """DefaultLoadPlanner with ``torch.load(weights_only=True)`` for non-tensors."""

            def load_bytes(self, read_item: Any, value: Any) -> None:
                obj = torch.load(value, weights_only=True)
                if self.flatten_state_dict:
                    from torch.distributed.checkpoint._traverse import set_element

                    fqn = self.mappings[read_item.dest_index.fqn]
                    set_element(self.original_state_dict, fqn, obj)
                else:
                    self.state_dict[read_item.dest_index.fqn] = obj

        state_dict_loader.load(state, checkpoint_id=str(path), planner=_WeightsOnlyPlanner())
        return state
