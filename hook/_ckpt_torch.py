"""The checkpoint writer's torch side, imported lazily there: the process group, the
host-memory staging copy of an async save, and loading without unpickling."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def distributed() -> Any:
    """``torch.distributed`` if a process group is initialised, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def require_numpy() -> None:
    """torch.distributed.checkpoint saves with numpy: checked when the writer is built,
    where the user can act, not at the first ordered save, which would fail every rank."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise ModuleNotFoundError(
            "forewarn.hook.CheckpointWriter needs numpy (torch.distributed.checkpoint saves "
            "with it): pip install 'forewarn[hook]'", name="numpy") from None


def stage(obj: Any, previous: Any = None) -> Any:
    """A host-memory copy of ``obj`` that later training steps cannot change.

    Tensors are copied into ``previous``'s buffers where shape and dtype match (the last
    save's staging copy, whose write has finished): filling fresh memory costs its page
    faults, about 6x the copy itself (``bench/RESULTS.md``)."""
    import torch

    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if (isinstance(previous, torch.Tensor) and previous.shape == src.shape
                and previous.dtype == src.dtype and previous.layout == src.layout):
            return previous.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):
        old = previous if isinstance(previous, dict) else {}
        return {k: stage(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        prev = previous if isinstance(previous, list | tuple) else ()
        return type(obj)(stage(v, prev[i] if i < len(prev) else None)
                         for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def load_torch(path: Path) -> dict[str, Any]:
    import torch

    obj = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}/state.pt holds {type(obj).__name__}, not a dict")
    return obj

def load_dcp(path: Path, state: dict[str, Any] | None) -> dict[str, Any]:
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
