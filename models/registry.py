"""A versioned model registry on disk: every retrained candidate, which one runs, and why.

Layout of the registry directory (the collector's is ``<data_dir>/models``)::

    registry.json      which version runs, and every decision ever taken (append only)
    v0001.skops ...    every candidate, promoted or not (skops, allow-listed types)

Version 0 is the model shipped with forewarn (:func:`~.persist.load_default_model`): an
empty or missing registry runs it, so a new deployment starts from the shipped model and
adapts as promoted versions replace it. Each decision records the time, the version, the
version that ran before, ``promoted``/``refused``/``rolled_back``, the reason and the
shadow scores. ``registry.json`` and each model file are written aside, fsynced and renamed,
under an exclusive lock, so a crash or a second writer never leaves either half written; a
model file is in place before the decision that names it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from forewarn.errors import InputError
from forewarn.files import fsync_dir, write_atomic
from forewarn.models.persist import load_default_model, load_model, save_model
from forewarn.models.predictor import FailurePredictor

__all__ = ["SHIPPED", "ModelRegistry", "RegistryError"]

SHIPPED: Final = 0
"""The version number of the model shipped with forewarn."""

FORMAT: Final = "forewarn.models/registry"
_FILE = re.compile(r"^v(\d{4,})\.skops$")


class RegistryError(InputError, ValueError):
    """The registry cannot do what was asked (an unknown version, a damaged index)."""


class ModelRegistry:
    """The registry in directory ``root`` (created on the first write)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def index_path(self) -> Path:
        return self.root / "registry.json"

    def _index(self) -> dict[str, Any]:
        try:
            text = self.index_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"format": FORMAT, "current": SHIPPED, "decisions": []}
        try:
            index = json.loads(text)
        except ValueError as exc:
            raise RegistryError(f"{self.index_path}: not valid JSON: {exc}") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise RegistryError(f"{self.index_path}: not a forewarn model registry")
        return index

    def _write_index(self, index: dict[str, Any]) -> None:
        write_atomic(self.index_path, json.dumps(index, indent=1, sort_keys=True).encode(),
                     mode=0o644)
        fsync_dir(self.root)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The index, read and written back under an exclusive lock."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "registry.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            index = self._index()
            yield index
            self._write_index(index)

    def current(self) -> int:
        """The version that runs (0: the shipped model)."""
        return int(self._index()["current"])

    def decisions(self) -> list[dict[str, Any]]:
        """Every decision, oldest first."""
        return list(self._index()["decisions"])

    def versions(self) -> list[int]:
        """The stored versions, oldest first (0, the shipped model, is always there)."""
        found = (_FILE.match(p.name) for p in self.root.glob("v*.skops"))
        return [SHIPPED, *sorted(int(m.group(1)) for m in found if m)]

    def path(self, version: int) -> Path:
        """The model file of ``version`` (not for version 0)."""
        return self.root / f"v{version:04d}.skops"

    def load(self, version: int | None = None) -> FailurePredictor:
        """The model of ``version`` (default: the current one)."""
        v = self.current() if version is None else version
        if v == SHIPPED:
            return load_default_model()
        if not self.path(v).exists():
            raise self._unknown(v)
        return load_model(self.path(v))

    def add(self, model: FailurePredictor, *, promote: bool, reason: str,
            scores: dict[str, Any] | None = None, now: float | None = None) -> int:
        """Store ``model`` as the next version and record the decision about it; it runs
        from now on when ``promote``. Returns its version."""
        with self._locked() as index:
            version = max(self.versions()) + 1
            # Written aside and renamed: a crash never leaves a half-written version.
            tmp = save_model(model, self.root / f".v{version:04d}.skops.tmp")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.path(version))
            fsync_dir(self.root)
            self._decide(index, version, "promoted" if promote else "refused", reason,
                         scores, now)
            if promote:
                index["current"] = version
        return version

    def rollback(self, version: int, *, reason: str = "", now: float | None = None) -> None:
        """Run ``version`` (an earlier one, or 0: the shipped model) from now on."""
        with self._locked() as index:
            if version not in self.versions():
                raise self._unknown(version)
            self._decide(index, version, "rolled_back",
                         reason or f"rolled back to version {version} by the operator",
                         None, now)
            index["current"] = version

    def _unknown(self, version: int) -> RegistryError:
        return RegistryError(f"{self.root}: no model version {version} (have "
                             f"{', '.join(map(str, self.versions()))})")

    @staticmethod
    def _decide(index: dict[str, Any], version: int, decision: str, reason: str,
                scores: dict[str, Any] | None, now: float | None) -> None:
        index["decisions"].append({
            "time": time.time() if now is None else now, "version": version,
            "previous": int(index["current"]), "decision": decision, "reason": reason,
            "scores": scores or {}})
