"""Who this rank is: job id, rank, world size and local rank from the launcher's environment.

torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and ``TORCHELASTIC_RUN_ID`` (the
rendezvous id, ``"none"`` unless ``--rdzv-id`` or ``--standalone`` gave one); Slurm sets
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_JOB_ID`` and, in a task that
``srun`` started, ``SLURM_STEP_ID``: the job is then ``slurm-<job id>.<step id>``, since
steps of one allocation can run side by side, each with its own rank 0 (``slurm-<job id>``
in the batch script itself). Explicit arguments win.
Garbage in the environment is logged and replaced by the default: the hook never stops a
training run because of a variable it does not own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["RankIdentity", "identity_from_env"]

_log = logging.getLogger("forewarn.hook")

_MAX_NAME = 256  # wire.Name max_length
_MAX_RANK = 1_000_000  # wire.Rank le
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0  # batch, extern, interactive... steps are ids above this


@dataclasses.dataclass(frozen=True)
class RankIdentity:
    """The fields every record of this rank carries."""

    job: str
    rank: int
    world_size: int
    local_rank: int
    pid: int
    host: str


def _env_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            _log.warning("forewarn: ignoring %s=%r (not an integer)", name, raw)
    return default


def _env_job(env: Mapping[str, str]) -> str:
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID", "")
        if step.isdigit() and int(step) < _SLURM_SPECIAL_STEPS:
            return f"slurm-{env['SLURM_JOB_ID']}.{step}"
        return "slurm-" + env["SLURM_JOB_ID"]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        # torchrun without a rendezvous id: the store address is shared by all ranks
        return f"torchrun-{env['MASTER_ADDR']}-{env['MASTER_PORT']}"
    return f"local-{socket.gethostname()}-{os.getpid()}"


def identity_from_env(
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    env: Mapping[str, str] | None = None,
) -> RankIdentity:
    """Resolve the rank's identity; explicit arguments override the environment.

    Raises :class:`ValueError` only for bad *explicit* arguments (a programming error at
    construction time, never inside the training loop).
    """
    e = os.environ if env is None else env
    job_id = job if job is not None else _env_job(e)
    r = rank if rank is not None else _env_int(e, ("RANK", "SLURM_PROCID"), 0)
    ws = world_size if world_size is not None else _env_int(e, ("WORLD_SIZE", "SLURM_NTASKS"), 1)
    lr = local_rank if local_rank is not None else _env_int(e, ("LOCAL_RANK", "SLURM_LOCALID"), 0)
    if not 1 <= len(job_id) <= _MAX_NAME:
        raise ValueError(f"job must be 1..{_MAX_NAME} characters, got {len(job_id)}")
    if not 1 <= ws <= _MAX_RANK:
        raise ValueError(f"world_size must be in 1..{_MAX_RANK}, got {ws}")
    if not 0 <= r < ws:
        raise ValueError(f"rank must be in 0..world_size-1 ({ws - 1}), got {r}")
    if not 0 <= lr <= _MAX_RANK:
        raise ValueError(f"local_rank must be in 0..{_MAX_RANK}, got {lr}")
    host = (socket.gethostname() or "unknown")[:_MAX_NAME]
    return RankIdentity(
        job=job_id, rank=r, world_size=ws, local_rank=lr, pid=os.getpid(), host=host
    )
