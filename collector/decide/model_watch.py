"""The model registry's current version, followed while the collector runs.

``forewarn models retrain`` (a promotion) and ``forewarn models rollback`` change which
version of the registry (:mod:`forewarn.models.registry`) runs by rewriting its
``registry.json``. :class:`RegistryWatch` notices that cheaply: :meth:`RegistryWatch.poll`,
called on the live scorer's cadence (every ``predict_interval_s``), compares one ``stat`` of
``registry.json`` (modification time, size, inode: the registry replaces the file whole)
with the one at the last load. Only when it changed is the index read, on a thread of its
own, and only when it names another version is that model loaded there (skops and its
allow-list check take a second or more): the scorer goes on with the running model
meanwhile and takes the new one at the next poll after it is in. A version that cannot be
loaded leaves the running model in place, logged and kept in :attr:`RegistryWatch.error`
(``/readyz`` shows it) until ``registry.json`` changes again.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forewarn.models.predictor import FailurePredictor

__all__ = ["RegistryWatch", "source_of"]

log = logging.getLogger(__name__)


def source_of(version: int) -> str:
    """How the API and ``/readyz`` name a registry version (0: ``default``, the shipped
    model)."""
    return "default" if version == 0 else f"registry v{version}"


class RegistryWatch:
    """The registry in directory ``root`` (see the module docstring). :meth:`load` and
    :meth:`poll` are called from one thread at a time (the loading thread at start, then
    the policy thread); the reload thread hands its model over through one attribute."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version: int | None = None
        """The version loaded last (None: none yet)."""
        self.loading = False
        """A changed registry is being read, or its new version loaded."""
        self.error = ""
        """Why the registry's current version could not be loaded ("" when it could)."""
        self._stamp: tuple[int, int, int] | None = None
        self._ready: tuple[FailurePredictor, str] | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.root / "registry.json")
        except OSError:  # no registry yet: the shipped model
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def load(self) -> tuple[FailurePredictor, str]:
        """The current version's model and its name, loaded now (blocking). Raises as
        :meth:`~forewarn.models.registry.ModelRegistry.load`."""
        from forewarn.models.registry import ModelRegistry

        # Stat first: a decision written while this loads is seen by the next poll.
        self._stamp = self._stat()
        registry = ModelRegistry(self.root)
        version = registry.current()
        model = registry.load(version)
        self.version = version
        return model, source_of(version)

    def poll(self) -> tuple[FailurePredictor, str] | None:
        """A model to run from now on (loaded since the last poll), else None; starts
        reading the registry in the background when ``registry.json`` changed."""
        ready, self._ready = self._ready, None
        if ready is not None or self.loading:
            return ready
        stamp = self._stat()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        self.loading = True
        threading.Thread(target=self._reload, name="forewarn-model-reload",
                         daemon=True).start()
        return None

    def _reload(self) -> None:
        from forewarn.models.registry import ModelRegistry

        try:
            registry = ModelRegistry(self.root)
            version = registry.current()
            if version != self.version:
                model = registry.load(version)
                self.version = version
                self._ready = (model, source_of(version))
                log.info("failure predictor: the registry now runs %s", source_of(version))
            self.error = ""
        except Exception as exc:  # RegistryError, ModelError, OSError: keep the running one
            self.error = str(exc) or type(exc).__name__
            log.error("failure predictor: keeps its model; the registry's current version "
                      "could not be loaded: %s", self.error)
        finally:
            self.loading = False
