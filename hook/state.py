"""The whole training state, so that a resumed run continues bit for bit.

:class:`TrainingState` gathers what a run needs besides its weights: the optimizer (with
its momentum), the LR scheduler, the GradScaler, an EMA, the step, the data position
(a :class:`ResumableSampler` or any object with ``state_dict``/``load_state_dict``, such
as torchdata's ``StatefulDataLoader``) and the random number generators (python
``random``, numpy's global generator, torch CPU and every CUDA device). It is saved and
loaded through :class:`~forewarn.hook.CheckpointWriter`, so it gets the writer's atomic,
verified, sharded (DCP) and two-tier saves::

    state = TrainingState(model, optimizer, scheduler=sched, sampler=sampler)
    start = state.resume(writer)                   # 0 when there is no checkpoint
    for step in range(start, steps):
        ...
        if monitor.should_checkpoint(step):
            writer.save(step, state.state_dict(step))

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict``/``set_state_dict``, which handle plain modules, DDP and FSDP2
(``fully_shard``) alike; with a process group the writer shards them with DCP.

Everything is stored in a form ``torch.load(weights_only=True)`` accepts: the RNG states
become tensors (numpy's ``('MT19937', uint32 array, ...)`` tuple, which weights-only
loading refuses, is split into tensors). State that differs per rank (RNGs, the data
position) lives under ``ranks.<rank>``; resuming needs the same world size or a smaller one.

Two things a loop must do for a bit-identical resume, because they are outside any
saved state: call ``torch.use_deterministic_algorithms(True)``, and give the
``DataLoader`` its own ``generator=torch.Generator()`` — otherwise creating the data
iterator draws its worker base seed from the global torch generator, and a run resumed
mid-epoch creates one more iterator than the uninterrupted run did.

torch is imported lazily.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .checkpoint import CheckpointWriter

__all__ = ["ResumableSampler", "Stateful", "TrainingState"]

_log = logging.getLogger("forewarn.hook")


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (schedulers, scalers,
    EMA models, samplers, stateful data loaders)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


def _rank() -> int:
    from ._ckpt_torch import distributed

    dist = distributed()
    return int(dist.get_rank()) if dist is not None else 0


class TrainingState:
    """Captures and restores the complete state of a training run.

    Args:
        model: the module being trained (plain, DDP-wrapped or ``fully_shard``-ed).
        optimizer: its optimizer, or None.
        scheduler, scaler, ema: an LR scheduler, a ``torch.amp.GradScaler``, an EMA
            (e.g. ``torch.optim.swa_utils.AveragedModel``); any of them may be None. They
            are the same on every rank.
        sampler: the data position of this rank: a :class:`ResumableSampler` or any
            object with ``state_dict``/``load_state_dict``.
        extra: more named objects with ``state_dict``/``load_state_dict``, the same on
            every rank.
        rng: save and restore the random number generators (default True).
    """

    def __init__(
        self, model: Any, optimizer: Any = None, *, scheduler: Stateful | None = None,
        scaler: Stateful | None = None, ema: Stateful | None = None,
        sampler: Stateful | None = None, extra: Mapping[str, Stateful] | None = None,
        rng: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        named = {"scheduler": scheduler, "scaler": scaler, "ema": ema, **(extra or {})}
        self._shared = {k: v for k, v in named.items() if v is not None}
        self._per_rank = {"sampler": sampler} if sampler is not None else {}
        for name, obj in {**self._shared, **self._per_rank}.items():
            if name in ("step", "model", "optim", "ranks"):
                raise ValueError(f"extra: {name!r} is a reserved name")
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"{name}: {type(obj).__name__} has no state_dict/load_state_dict")
        self.rng = rng

    def state_dict(self, step: int) -> dict[str, Any]:
        """The state after ``step``, ready for ``CheckpointWriter.save(step, ...)``.

        Model and optimizer tensors are the live ones (not copies): save before the next
        step changes them, or use ``save_async``, which stages a copy first.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.model, [] if self.optimizer is None else self.optimizer)
        state: dict[str, Any] = {"step": step, "model": model_sd}
        if self.optimizer is not None:
            state["optim"] = optim_sd
        for name, obj in self._shared.items():
            state[name] = obj.state_dict()
        mine = {name: obj.state_dict() for name, obj in self._per_rank.items()}
        if self.rng:
            mine["rng"] = capture_rng()
        if mine:
            state["ranks"] = {str(_rank()): mine}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Restore everything from ``state`` (as loaded by the writer); returns its step."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, [] if self.optimizer is None else self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"] if self.optimizer is not None else {},
        )
        for name, obj in self._shared.items():
            obj.load_state_dict(state[name])
        mine = state.get("ranks", {}).get(str(_rank()), {})
        for name, obj in self._per_rank.items():
            obj.load_state_dict(mine[name])
        if self.rng:
            restore_rng(mine["rng"])  # last: nothing above may draw after it
        return int(state["step"])

    def resume(self, writer: CheckpointWriter, *, allow_suspect: bool = False) -> int:
        """Load the newest intact checkpoint of ``writer`` into this state; returns the
        first step to run (0 when there is none). Every rank must call it. Checkpoints
        marked suspect (bad numerics) are skipped unless ``allow_suspect``."""
        from ._ckpt_torch import distributed

        fresh = self.optimizer is not None and not self.optimizer.state
        # a DCP load fills a template in place; get_state_dict builds a fresh optimizer's
        # state by a zero-lr step (torch's _init_optim_state), undone below if unused
        template = self.state_dict(-1) if distributed() is not None else None
        loaded = writer.load_latest(template, allow_suspect=allow_suspect)
        if loaded is None:
            if fresh:
                self.optimizer.state.clear()  # e.g. Adam's step count must start at 0
            return 0
        return self.load_state_dict(loaded.state) + 1


# ---------------------------------------------------------------------- RNG states


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors (loadable with ``weights_only=True``)."""
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": torch.tensor(version, dtype=torch.int64),
            "state": torch.tensor(internal, dtype=torch.int64),
            # gauss_next is None or a float: [present, value]
            "gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        },
        "torch": torch.get_rng_state(),
    }
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        if name != "MT19937":  # legacy=True always gives MT19937; keep the check honest
            raise ValueError(f"numpy global RNG is {name}, expected MT19937")
        state["numpy"] = {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
            "gauss": torch.tensor(cached, dtype=torch.float64),
        }
    if torch.cuda.is_available():
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set this process's RNGs from :func:`capture_rng`'s output."""
    import torch

    py = state["python"]
    present, value = py["gauss"].tolist()
    random.setstate((int(py["version"]), tuple(py["state"].tolist()),
                     value if present else None))
    torch.set_rng_state(state["torch"])
    np = _numpy()
    if np is not None and "numpy" in state:
        npst = state["numpy"]
        pos, has_gauss = npst["pos"].tolist()
        np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), pos,
                             has_gauss, float(npst["gauss"])))
    cuda = state.get("cuda", {})
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if len(cuda) != n:
            _log.warning("forewarn: checkpoint has RNG states for %d CUDA devices, this "
                         "process sees %d; restoring the first %d", len(cuda), n, min(n, len(cuda)))
        for i in range(min(n, len(cuda))):
            torch.cuda.set_rng_state(cuda[str(i)], i)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


# ---------------------------------------------------------------------- sampler


class ResumableSampler:
    """A shuffling, rank-sharded sampler (like ``DistributedSampler``) that remembers
    how far it got, so a resumed run continues mid-epoch with the same order.

    Each epoch is a permutation of ``range(length)`` drawn from ``seed + epoch``, padded
    to a multiple of ``num_replicas`` (or cut, with ``drop_last``) and split by rank.
    The position counts the indices handed out, which is exact with ``num_workers=0``;
    with worker processes the DataLoader prefetches ahead of the loop, so use a stateful
    data loader (torchdata's ``StatefulDataLoader``) instead. A new iteration after the
    epoch is exhausted starts the next epoch; :meth:`set_epoch` is optional.
    """

    def __init__(
        self, length: int, *, shuffle: bool = True, seed: int = 0, num_replicas: int | None = None,
        rank: int | None = None, drop_last: bool = False,
    ) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if num_replicas is None or rank is None:
            from ._ckpt_torch import distributed

            dist = distributed()
            num_replicas = num_replicas if num_replicas is not None else (
                dist.get_world_size() if dist is not None else 1)
            rank = rank if rank is not None else (dist.get_rank() if dist is not None else 0)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.length, self.shuffle, self.seed = length, shuffle, seed
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last
        self.epoch = 0
        self.consumed = 0
        """Indices of the current epoch already handed out on this rank."""

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.num_replicas
        return -(-self.length // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its position, so a
        resumed loop may call this again for the epoch it resumes in."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def _indices(self) -> list[int]:
        import torch

        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        total = len(self) * self.num_replicas
        if total > len(order) and order:  # pad by repeating from the start
            order += (order * (total // len(order) + 1))[: total - len(order)]
        return order[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.consumed >= len(self):
            self.epoch, self.consumed = self.epoch + 1, 0
        indices = self._indices()
        while self.consumed < len(indices):
            i = indices[self.consumed]
            self.consumed += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        """Epoch and position (plain ints; the order itself is recomputed from the seed)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "length": self.length}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; the dataset and seed must be the same."""
        if int(state["length"]) != self.length or int(state["seed"]) != self.seed:
            raise ValueError(
                f"sampler state is for length {state['length']} seed {state['seed']}, "
                f"this sampler has length {self.length} seed {self.seed}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
