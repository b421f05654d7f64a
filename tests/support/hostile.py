"""Hostile strings for output tests: each must come out of every output escaped, bounded
and valid UTF-8."""

from __future__ import annotations

__all__ = ["AWKWARD", "HOSTILE", "TEN_KB"]

HOSTILE = [
    "team/a/run-1",
    "q\"uo'te\\",
    "<script>window.__xss=1</script>",
    '<img src=x onerror="window.__xss=1">',
    "line\nbreak\r\nthird",
    "🚀𝕏-non-bmp-\U0010fffd",
    "x" * 256,
    "..",
    "<!channel> <https://evil.example|click> &amp;",
]
"""Job names that pass the wire (a ``Name`` is 1..256 characters of any Unicode)."""
TEN_KB = "n" * 10_000
"""Longer than any name the wire accepts: for free text (reasons, evidence, driver names)."""
AWKWARD = [*HOSTILE, "a%2Fb", " spaced name ", "../etc", "a/../b", "./x", "?q=1#f", "a\tb",
           "\x00nul", "%", "é/🚀/", "/", "."]
"""Job names a URL path cannot carry as they are (``..`` and ``.`` are normalised away by
clients, a newline does not match a path parameter, ``%2F`` is decoded once more by some
proxies), plus :data:`HOSTILE`."""
