"""The root of forewarn's own errors, and its few branches.

Every exception forewarn defines derives from :class:`ForewarnError`, so a caller that embeds
forewarn can tell its errors from everyone else's with one ``except``. The branches say what
kind of trouble it is:

- :class:`InputError`: something from outside is wrong: a config key, a wire record, a request,
  a data file, a model file, a template. The message names the field; retrying does not help.
- :class:`StorageError`: the collector's data on disk cannot be read or written.
- :class:`UnavailableError`: something forewarn depends on is not there (a GPU source, a
  socket, a server); retrying later may help.

Each concrete error keeps the standard base it always had (``ValueError``, ``OSError``,
``RuntimeError``) as well, so code that catches those still does.
"""

from __future__ import annotations

__all__ = ["ForewarnError", "InputError", "StorageError", "UnavailableError"]


class ForewarnError(Exception):
    """Base of every error forewarn raises on purpose."""


class InputError(ForewarnError):
    """Bad input from outside (config, wire record, request, file); the message names it."""


class StorageError(ForewarnError):
    """The collector's stored data cannot be read or written."""


class UnavailableError(ForewarnError):
    """Something forewarn needs is not there right now (a source, a socket, a server)."""
