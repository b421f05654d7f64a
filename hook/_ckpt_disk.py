"""A checkpoint on disk: the layout, the manifest, the commit protocol, suspect markers,
pruning and verification (see :mod:`forewarn.hook.checkpoint`). Standard library only."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_log = logging.getLogger("forewarn.hook")

STEP_DIR = re.compile(r"^step-(\d{9,})$")
MANIFEST = "manifest.json"
SUSPECT = "suspect.json"
"""Marker of a checkpoint written from a suspect training state (outside the manifest, so
a committed checkpoint can be marked later)."""
FORMAT = "forewarn-checkpoint"


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def remove_temps(directory: Path) -> None:
    for p in directory.iterdir():
        if p.name.startswith((".tmp-step-", ".old-step-")) and p.is_dir():
            _log.info("forewarn: removing incomplete checkpoint %s", p)
            shutil.rmtree(p, ignore_errors=True)


def list_checkpoints(directory: Path | None) -> list[tuple[int, Path]]:
    if directory is None or not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def commit(directory: Path, step: int, tmp: Path, phase: Callable[[str, Path], None]) -> Path:
    """Make the complete ``tmp`` the checkpoint of ``step`` in ``directory``."""
    fsync_dir(tmp)
    phase("manifest", tmp)
    final = directory / step_name(step)
    trash = None
    if final.exists():  # the same step saved again (e.g. after a resume)
        trash = directory / (".old-" + step_name(step))
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
    tmp.rename(final)
    phase("renamed", final)
    fsync_dir(directory)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def suspect_mark(path: Path) -> dict[str, Any] | None:
    """The suspect marker of the checkpoint at ``path``, or None when it is not suspect (an
    unreadable marker counts as suspect)."""
    try:
        mark = json.loads((path / SUSPECT).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"reason": f"unreadable {SUSPECT}: {exc}"}
    return mark if isinstance(mark, dict) else {"reason": f"malformed {SUSPECT}"}


def write_mark(path: Path, onset: int) -> None:
    """Mark the checkpoint at ``path`` suspect since ``onset`` (atomic, fsynced)."""
    data = json.dumps({"onset_step": onset, "marked": time.time(),
                       "reason": f"training state suspect since step {onset}"}).encode()
    tmp = path / f".{SUSPECT}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path / SUSPECT)
    fsync_dir(path)


def prune(directory: Path, keep_last: int, keep: set[int] | None = None) -> None:
    found = list_checkpoints(directory)
    # the newest checkpoint that is not suspect stays whatever came after it
    good = [step for step, p in found if suspect_mark(p) is None]
    newest_good = good[-1] if good else None
    for step, p in found[:-keep_last]:
        if (keep is None or step not in keep) and step != newest_good:
            shutil.rmtree(p, ignore_errors=True)


def copy_file(src: Path, dst: Path, phase: Callable[[str, Path], None]) -> str:
    """Copy ``src`` to ``dst`` and fsync it; returns the sha256 of what was copied."""
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for block in iter(lambda: fin.read(8 << 20), b""):
            fout.write(block)
            h.update(block)
            phase("copy", dst)
            phase = no_phase
        fout.flush()
        os.fsync(fout.fileno())
    return h.hexdigest()


def no_phase(phase: str, path: Path) -> None:
    pass


def verify(path: str | os.PathLike[str]) -> str | None:
    """``None`` if the checkpoint at ``path`` is intact, else why it is not."""
    p = Path(path)
    try:
        manifest = json.loads((p / MANIFEST).read_bytes())
    except FileNotFoundError:
        return "manifest.json missing"
    except (OSError, ValueError) as exc:
        return f"manifest.json unreadable: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
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
        if sha256(f) != entry.get("sha256"):
            return f"{name} sha256 mismatch"
    return None


def rank_bytes(tmp: Path, final: Path, rank: int) -> int:
    """Bytes of ``rank``'s shard files of a DCP save (``FileSystemWriter`` names them
    ``__<rank>_<n>.distcp``): in ``tmp``, or in ``final`` once rank 0 has committed. Rank 0
    commits (renames ``tmp`` to ``final``) as soon as its own ``dcp.save`` returns, so the
    rename can land while this rank is still counting: then every file is in ``final``."""
    prefix = f"__{rank}_"
    for where in (tmp, final):
        try:
            return sum((where / n).stat().st_size for n in os.listdir(where)
                       if n.startswith(prefix))
        except FileNotFoundError:
            continue  # renamed away mid-count: look in the committed directory
    raise FileNotFoundError(f"rank {rank}'s shard files are in neither {tmp} nor {final}")


def write_manifest(tmp: Path, step: int, kind: str, world: int, files: list[str]) -> int:
    """fsync ``files`` in ``tmp`` and write the fsynced manifest listing their sizes and
    sha256; returns the bytes of files and manifest together."""
    entries: dict[str, dict[str, Any]] = {}
    total = 0
    for name in files:
        p = tmp / name
        fsync_file(p)
        size = p.stat().st_size
        total += size
        entries[name] = {"bytes": size, "sha256": sha256(p)}
    manifest = {
        "format": FORMAT, "version": 1, "step": step, "kind": kind,
        "world_size": world, "created": time.time(), "files": entries,
    }
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    with open(tmp / MANIFEST, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return total + len(data)


def copy_files(src: Path, tmp: Path, phase: Callable[[str, Path], None]) -> None:
    """Copy the committed checkpoint ``src`` into the empty ``tmp``: its files, each
    checked against the manifest's sha256 as it is read, then the manifest (fsynced)."""
    manifest = json.loads((src / MANIFEST).read_bytes())
    for name, entry in sorted(manifest["files"].items()):
        if copy_file(src / name, tmp / name, phase) != entry["sha256"]:
            raise OSError(f"{src / name} changed while it was copied")
        phase = no_phase  # the "copy" phase: the first block of the first file
    shutil.copyfile(src / MANIFEST, tmp / MANIFEST)
    fsync_file(tmp / MANIFEST)
