"""The repository stands alone: nothing points at files a user does not have (a sibling
``shared/`` folder, ``REFERENCE.md``, ``DESIGN.md``); the design and the facts the code
cites live in ``docs/``, and the LICENSE the metadata declares is there."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP = {".venv", "build", "dist", ".git", "node_modules"}
OUTSIDE = re.compile(r"\.\./shared/|\bshared/DESIGN|\bREFERENCE\.md|\bDESIGN\.md")


def _sources() -> list[Path]:
    out = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if (rel.parts and rel.parts[0] in SKIP) or not path.is_file():
            continue
        if path.suffix in {".py", ".md", ".toml", ".yml", ".service"} and path != Path(__file__):
            out.append(path)
    return out


def test_nothing_points_outside_the_repository() -> None:
    bad = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in _sources()
           for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if OUTSIDE.search(line)]
    assert bad == []


def test_cited_docs_exist() -> None:
    cited = {m for p in _sources()
             for m in re.findall(r"\bdocs/[\w./-]+\.md", p.read_text(errors="replace"))}
    assert {"docs/design.md", "docs/reference.md"} <= cited
    assert [c for c in sorted(cited) if not (REPO / c).is_file()] == []


def test_license_is_the_one_the_metadata_declares() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
