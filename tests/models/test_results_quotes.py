"""bench/RESULTS.md says which of its goodput figures the README quotes: a paragraph that
says "The README quotes these" has every percentage it gives in the README (a stale claim
sends a reader to figures the README does not show)."""

from __future__ import annotations

import re

from support.paths import REPO

_PERCENT = re.compile(r"\b\d+\.\d+ %")


def test_each_paragraph_the_readme_is_said_to_quote_is_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    quoted = [p for p in (REPO / "bench" / "RESULTS.md").read_text().split("\n\n")
              if "README quotes these" in p.replace("\n", " ")]
    assert quoted
    missing = {p.split("\n")[0]: [f for f in _PERCENT.findall(p) if f not in readme]
               for p in quoted}
    assert {k: v for k, v in missing.items() if v} == {}
