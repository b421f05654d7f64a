"""A default checkpoint writer for users who have none.

Layout: ``<directory>/step-000000042/`` holding the state file(s) and ``manifest.json``
(step, format, and per file its size and sha256). A checkpoint becomes visible only
complete (committed): everything is written into ``.tmp-step-000000042`` in the same
directory, each file is fsynced, the manifest is written and fsynced, the temp directory
is fsynced and renamed, then the parent directory is fsynced, so a crash at any point
leaves either the old set or the new one (plus a temp directory that the next save
removes). The newest ``keep_last`` checkpoints are kept.

Two formats:

* ``torch``: one ``state.pt`` by ``torch.save`` (one process, no process group).
* ``dcp``: when ``torch.distributed`` is initialised, :mod:`torch.distributed.checkpoint`
  writes one shard per rank; every rank must call ``save`` at the same step (which the
  checkpoint orders ensure). Rank 0 writes the manifest and renames.

:meth:`CheckpointWriter.save_async` blocks only while the state is copied to host memory
(``torch.distributed.checkpoint.async_save`` with a process group, a copy of every tensor
without); writing *and committing* run in a background thread, so the checkpoint is
durable when the write ends whether or not anyone calls ``wait()``.

Two tiers: with ``durable=DIR`` every committed checkpoint is then copied in the
background from the fast ``directory`` (a local disk) to ``DIR`` (shared or network
storage), files first and the manifest last, into a temp directory renamed when complete.
:meth:`~CheckpointWriter.load_latest` takes the newest intact checkpoint of either tier.
With several ranks, rank 0 copies the whole checkpoint, so the fast directory must be one
that rank 0 sees in full (one node, or a shared file system).

:meth:`CheckpointWriter.load_latest` verifies the manifest and every sha256 and falls back
to the previous good checkpoint when the newest is corrupt, logging what it skipped and
why. Loading never unpickles arbitrary objects: ``torch.load(weights_only=True)``, and for
DCP a load planner whose ``load_bytes`` also uses ``weights_only=True`` (torch's default
planner uses ``weights_only=False`` there).

**Suspect checkpoints.** With a ``monitor`` whose training state turned suspect (a NaN/Inf
loss, or the collector's save hold after a grad-norm spike: see
:attr:`forewarn.hook.Monitor.suspect_since`), a checkpoint of the onset step or later gets a
``suspect.json`` marker (onset step, reason) in its directory before it is committed, and
committed checkpoints from the onset on are marked when the monitor learns of it (in both
tiers; the durable copy carries the marker). ``load_latest`` skips suspect checkpoints
unless ``allow_suspect=True``; pruning never deletes the newest checkpoint that is not
suspect, so ``keep_last`` poisoned saves cannot rotate the last good one out. While the
monitor holds saves (:meth:`~forewarn.hook.Monitor.saves_held`), ``save`` and
``save_async`` refuse (nothing is written; the result's ``refused`` says why and the
monitor hears ``checkpoint_failed``) unless ``allow_suspect=True``.

torch is imported lazily, on the first save or load. The files on disk (layout, manifest,
commit, markers, pruning, verification) are ``_ckpt_disk.py``; the torch side (process
group, staging copy, loading) ``_ckpt_torch.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _ckpt_disk as disk
from ._ckpt_disk import MANIFEST, SUSPECT
from ._ckpt_results import CheckpointResult, LoadedCheckpoint
from ._ckpt_torch import distributed, load_dcp, load_torch, require_numpy, stage

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["CheckpointResult", "CheckpointWriter", "LoadedCheckpoint", "PendingCheckpoint"]

_log = logging.getLogger("forewarn.hook")

class PendingCheckpoint:
    """A save in flight; :meth:`wait` returns its :class:`CheckpointResult`.

    The checkpoint commits in the background as soon as it is written; ``wait`` only
    reports it (to the monitor, in the caller's thread) and raises what the save raised.
    """

    def __init__(self, future: Future[CheckpointResult], report: Callable[[CheckpointResult], None]
                 ) -> None:
        self._future = future
        self._report = report
        self._reported = False
        self._raised = False

    def done(self) -> bool:
        """Whether the save has finished (committed, or failed)."""
        return self._future.done()

    def wait(self) -> CheckpointResult:
        """Block until written, manifested and renamed (idempotent)."""
        try:
            result = self._future.result()
        except BaseException:
            self._raised = True
            raise
        if not self._reported:
            self._reported = True
            self._report(result)
        return result

    def _settle(self) -> None:
        """Wait for the save; raise its failure unless a ``wait()`` already raised it."""
        if self._raised:
            self._future.exception()
        else:
            self.wait()


def _logged(write: Callable[[], CheckpointResult]) -> CheckpointResult:
    """Run a background save; a failure is logged at once (nobody may be waiting), and
    raised again by ``wait()``."""
    try:
        return write()
    except BaseException as exc:
        _log.error("forewarn: background checkpoint save failed: %r", exc)
        raise


def _done(result: CheckpointResult) -> Future[CheckpointResult]:
    f: Future[CheckpointResult] = Future()
    f.set_result(result)
    return f


def _no_report(result: CheckpointResult) -> None:
    pass


class CheckpointWriter:
    """Atomic, verified, keep-last-N checkpoints (see module docstring).

    Args:
        directory: where checkpoints live (created if missing); with ``durable``, the
            fast tier (a local disk).
        keep_last: how many complete checkpoints to keep in each tier (>= 1).
        durable: optional second tier, filled in the background from ``directory``.
        monitor: if given, each save reports itself with ``checkpoint_done``.
        clock: monotonic clock for durations (injectable).
        on_phase: called as ``on_phase(phase, path)`` at each point of a save where a
            crash leaves a different state on disk: ``"begin"`` (empty temp directory),
            ``"written"`` (state files written), ``"manifest"`` (manifest written and
            fsynced, not yet renamed), ``"renamed"`` (committed), and in the durable tier
            ``"copy"`` (the first block of the first file copied) and the same
            ``"manifest"`` and ``"renamed"``. For tracing and crash tests.
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep_last: int = 3, *,
        durable: str | os.PathLike[str] | None = None, monitor: Monitor | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_phase: Callable[[str, Path], None] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        require_numpy()
        self.directory = Path(directory)
        self.durable = Path(durable) if durable is not None else None
        if self.durable is not None and self.durable.resolve() == self.directory.resolve():
            raise ValueError("durable must be a different directory")
        self.keep_last = keep_last
        self.monitor = monitor
        self._clock = clock
        self._phase = on_phase or disk.no_phase
        self._pending: PendingCheckpoint | None = None
        self._async_group: Any = None
        self._worker: ThreadPoolExecutor | None = None
        self._copies: list[Future[None]] = []
        self._staged: Any = None  # the last async save's host copy, reused by the next
        self._to_copy: set[int] = set()  # steps queued for the durable tier
        self._lock = threading.Lock()  # _to_copy and pruning: caller and background thread
        # suspect marking against commits: a checkpoint is marked before it is visible, or
        # found committed by the marking pass (the monitor's thread)
        self._mark_lock = threading.Lock()
        if monitor is not None:
            monitor.on_suspect(self.mark_suspect)
        self.copy_failures = 0
        """Copies to the durable tier that failed (each is logged; the fast tier keeps it)."""

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any], *, allow_suspect: bool = False
             ) -> CheckpointResult:
        """Write ``state`` as the checkpoint of ``step`` and wait until it is committed.

        Refused (``result.refused``) while the monitor holds saves, unless
        ``allow_suspect`` (the checkpoint is then marked suspect)."""
        return self._save(step, state, use_async=False, allow_suspect=allow_suspect).wait()

    def save_async(self, step: int, state: dict[str, Any], *, allow_suspect: bool = False
                   ) -> PendingCheckpoint:
        """Like :meth:`save`, but return once ``state`` is copied to host memory; the
        write and the commit run in the background (with a process group through
        ``torch.distributed.checkpoint.async_save``). The checkpoint is committed when
        the write ends, without :meth:`PendingCheckpoint.wait`; the next save, and
        :meth:`close`, wait for it first."""
        return self._save(step, state, use_async=True, allow_suspect=allow_suspect)

    def _refused(self, step: int) -> PendingCheckpoint | None:
        """A refused save's result while the monitor holds saves, else None."""
        mon = self.monitor
        if mon is None or not mon.saves_held(step):
            return None
        why = f"saves held: the training state is suspect since step {mon.suspect_since}"
        _log.warning("forewarn: checkpoint of step %d refused: %s", step, why)
        mon.checkpoint_failed(step, why)
        return PendingCheckpoint(_done(CheckpointResult(step, "", 0.0, 0, refused=why)),
                                 _no_report)

    def _background(self) -> ThreadPoolExecutor:
        # one thread: commits and tier copies run in the order they were asked for
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="forewarn-checkpoint")
        return self._worker

    def _save(self, step: int, state: dict[str, Any], use_async: bool,
              allow_suspect: bool = False) -> PendingCheckpoint:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        refused = None if allow_suspect else self._refused(step)
        if refused is not None:
            return refused
        if self._pending is not None:  # one save in flight at a time
            pending, self._pending = self._pending, None
            pending._settle()
        t0 = self._clock()
        self.directory.mkdir(parents=True, exist_ok=True)
        dist = distributed()
        rank = dist.get_rank() if dist is not None else 0
        tmp = self.directory / (".tmp-" + disk.step_name(step))
        if rank == 0:
            disk.remove_temps(self.directory)
            tmp.mkdir()
            self._phase("begin", tmp)
        if dist is None:
            if not use_async:
                pending = PendingCheckpoint(_done(self._write_torch(step, tmp, state, t0)),
                                            self._report)
            else:
                # the previous save has finished (waited above): its buffers are free
                staged = self._staged = stage(state, self._staged)
                pending = PendingCheckpoint(self._background().submit(
                    _logged, lambda: self._write_torch(step, tmp, staged, t0)), self._report)
        else:
            dist.barrier()  # the temp directory exists (and is empty) for every rank
            pending = self._write_dcp(step, tmp, state, t0, use_async, dist)
        if use_async:
            self._pending = pending
        return pending

    def _write_torch(self, step: int, tmp: Path, state: dict[str, Any], t0: float
                     ) -> CheckpointResult:
        import torch

        with open(tmp / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return self._finish(step, tmp, t0, "torch", ["state.pt"], 1)

    def _write_dcp(
        self, step: int, tmp: Path, state: dict[str, Any], t0: float, use_async: bool, dist: Any,
    ) -> PendingCheckpoint:
        from torch.distributed.checkpoint import state_dict_saver

        rank, world = dist.get_rank(), dist.get_world_size()
        if use_async:
            if self._async_group is None:
                # background-thread collectives get their own gloo group, so they never
                # interleave with the training's collectives on the default group
                self._async_group = dist.new_group(backend="gloo")
            # a Future with the default (thread) checkpointer
            written: Any = state_dict_saver.async_save(
                state, checkpoint_id=str(tmp), process_group=self._async_group)

            def finish() -> CheckpointResult:
                written.result()
                return self._finish_dcp(step, tmp, t0, rank, world, dist, barrier=False)

            return PendingCheckpoint(self._background().submit(_logged, finish), self._report)
        state_dict_saver.save(state, checkpoint_id=str(tmp))
        result = self._finish_dcp(step, tmp, t0, rank, world, dist, barrier=True)
        return PendingCheckpoint(_done(result), self._report)

    def _finish_dcp(
        self, step: int, tmp: Path, t0: float, rank: int, world: int, dist: Any, barrier: bool,
    ) -> CheckpointResult:
        # every rank's files are complete once dcp.save returned on rank 0 (the
        # coordinator writes .metadata after gathering all ranks' write results)
        if rank == 0:
            files = sorted(p.name for p in tmp.iterdir() if p.is_file())
            result = self._finish(step, tmp, t0, "dcp", files, world)
        else:
            final = self.directory / disk.step_name(step)
            nbytes = disk.rank_bytes(tmp, final, rank)
            result = CheckpointResult(step, str(final), self._clock() - t0, nbytes)
        if barrier:
            dist.barrier()  # rank 0 has renamed: load_latest sees it on every rank
        if rank != 0:
            result = dataclasses.replace(result, seconds=self._clock() - t0)
        return result

    def _finish(
        self, step: int, tmp: Path, t0: float, kind: str, files: list[str], world: int,
    ) -> CheckpointResult:
        self._phase("written", tmp)
        total = disk.write_manifest(tmp, step, kind, world, files)
        with self._mark_lock:
            onset = self.monitor.suspect_since if self.monitor is not None else None
            suspect = onset is not None and step >= onset
            if suspect:
                assert onset is not None
                disk.write_mark(tmp, onset)
            final = disk.commit(self.directory, step, tmp, self._phase)
        if self.durable is not None:
            with self._lock:
                self._to_copy.add(step)
            self._copies = [c for c in self._copies if not c.done()]
            self._copies.append(self._background().submit(self._copy_to_durable, step, final))
        self._prune_fast()
        return CheckpointResult(step, str(final), self._clock() - t0, total, suspect=suspect)

    def _copy_to_durable(self, step: int, src: Path) -> None:
        """Copy the committed ``src`` into the durable tier: files, then the manifest,
        then the rename. Never raises: a failure is logged and counted."""
        assert self.durable is not None
        try:
            self.durable.mkdir(parents=True, exist_ok=True)
            disk.remove_temps(self.durable)
            tmp = self.durable / (".tmp-" + disk.step_name(step))
            tmp.mkdir()
            disk.copy_files(src, tmp, self._phase)
            with self._mark_lock:  # a mark made while copying comes along
                if (src / SUSPECT).exists():
                    shutil.copyfile(src / SUSPECT, tmp / SUSPECT)
                    disk.fsync_file(tmp / SUSPECT)
                disk.commit(self.durable, step, tmp, self._phase)
            disk.prune(self.durable, self.keep_last)
        except Exception as exc:
            self.copy_failures += 1
            _log.error("forewarn: copying checkpoint %s to %s failed: %r", src, self.durable, exc)
        with self._lock:
            self._to_copy.discard(step)
        self._prune_fast()

    def _prune_fast(self) -> None:
        # a checkpoint waiting for its copy to the durable tier stays until copied
        with self._lock:
            disk.prune(self.directory, self.keep_last, keep=self._to_copy)

    def mark_suspect(self, onset: int) -> list[Path]:
        """Mark every committed checkpoint of step ``onset`` or later, in both tiers,
        suspect (the monitor calls this when the state turns suspect); returns those
        newly marked. Never raises: a checkpoint pruned meanwhile is skipped."""
        marked = []
        with self._mark_lock:
            for directory in (self.directory, self.durable):
                for step, p in disk.list_checkpoints(directory):
                    if step < onset or disk.suspect_mark(p) is not None:
                        continue
                    try:
                        disk.write_mark(p, onset)
                    except OSError as exc:
                        _log.warning("forewarn: could not mark %s suspect: %r", p, exc)
                        continue
                    marked.append(p)
        for p in marked:
            _log.warning("forewarn: checkpoint %s marked suspect (state suspect since step %d)",
                         p, onset)
        return marked

    def _report(self, result: CheckpointResult) -> None:
        if self.monitor is not None:
            self.monitor.checkpoint_done(result.step, result.seconds, result.bytes, result.path)

    def flush(self) -> None:
        """Wait until the save in flight is committed and every copy to the durable tier
        has finished."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending._settle()
        for c in self._copies:
            c.result()
        self._copies = []

    def close(self) -> None:
        """:meth:`flush`, then release the background thread and the background save's
        process group. Call before ``torch.distributed.destroy_process_group()``: a gloo
        group whose threads are still alive at interpreter exit aborts the process."""
        self.flush()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        self._staged = None
        if self._async_group is not None:
            dist = distributed()
            if dist is not None:
                dist.destroy_process_group(self._async_group)
            self._async_group = None

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoint directories of the fast tier, oldest first (not verified)."""
        return disk.list_checkpoints(self.directory)

    # ------------------------------------------------------------------ load

    def verify(self, path: str | os.PathLike[str]) -> str | None:
        """``None`` if the checkpoint at ``path`` is intact, else why it is not."""
        return disk.verify(path)

    def _candidates(self) -> list[tuple[int, Path]]:
        """Checkpoints of both tiers, newest first; at the same step the fast tier first."""
        both = [(step, 0, p) for step, p in self.checkpoints()]
        both += [(step, 1, p) for step, p in disk.list_checkpoints(self.durable)]
        return [(step, p) for step, _, p in sorted(both, key=lambda c: (-c[0], c[1]))]

    def _intact(self, step: int) -> tuple[int, Path]:
        """The intact copy of ``step`` in either tier (the step the ranks agreed on)."""
        reasons = []
        for s, p in self._candidates():
            if s == step:
                reason = disk.verify(p)
                if reason is None:
                    return (step, p)
                reasons.append(f"{p}: {reason}")
        raise RuntimeError(f"ranks disagree on the checkpoint; step {step}: "
                           + ("; ".join(reasons) or "not found"))

    def load_latest(self, state: dict[str, Any] | None = None, *, allow_suspect: bool = False
                    ) -> LoadedCheckpoint | None:
        """Load the newest intact checkpoint, or ``None`` if there is none.

        ``state``: for DCP checkpoints, the state dict to load into in place (its tensors
        give shapes and shardings); for ``torch`` checkpoints it is not needed. With a
        process group every rank must call this; they agree on the step (the smallest
        of the ranks' choices, should their verification differ). Suspect checkpoints
        (see the module docstring) are skipped unless ``allow_suspect``.
        """
        skipped: list[tuple[str, str]] = []
        chosen: tuple[int, Path] | None = None
        for step, p in self._candidates():
            mark = None if allow_suspect else disk.suspect_mark(p)
            if mark is not None:
                _log.warning("forewarn: skipping suspect checkpoint %s: %s", p,
                             mark.get("reason", ""))
                skipped.append((str(p), f"suspect: {mark.get('reason', '')}"))
                continue
            reason = disk.verify(p)
            if reason is None:
                chosen = (step, p)
                break
            _log.warning("forewarn: skipping checkpoint %s: %s", p, reason)
            skipped.append((str(p), reason))
        dist = distributed()
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
                chosen = self._intact(agreed)
        if chosen is None:
            return None
        step, path = chosen
        kind = json.loads((path / MANIFEST).read_bytes())["kind"]
        loaded = load_dcp(path, state) if kind == "dcp" else load_torch(path)
        return LoadedCheckpoint(step=step, path=str(path), state=loaded, skipped=tuple(skipped),
                                suspect=disk.suspect_mark(path) is not None)
