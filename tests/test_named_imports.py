"""The import-linter contracts (pyproject.toml) also hold for modules run by name.

A part that starts another module as a program (``python -m NAME``, torchrun's module
argument) depends on it, but through a string that ``lint-imports`` cannot see: the demo
once ran the chaos lab's workload that way. Every string literal in a forbidden contract's
source modules that is exactly a forbidden module's name (or one of its submodules') fails
here; a module both may run lives where both may import it and is named by its
``__name__``."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

from support.paths import REPO

PACKAGE_DIRS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"]


def _files(module: str) -> Iterator[Path]:
    """The source files of package ``module`` (through pyproject's package-dir)."""
    head = max((k for k in PACKAGE_DIRS if module == k or module.startswith(k + ".")), key=len)
    folder = REPO / PACKAGE_DIRS[head] / Path(*module[len(head):].split(".")[1:])
    yield from sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]


def _named(path: Path, forbidden: list[str]) -> list[str]:
    pattern = re.compile("(" + "|".join(map(re.escape, forbidden)) + r")(\.\w+)*")
    return [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and pattern.fullmatch(node.value)]


def test_no_part_runs_by_name_a_module_it_may_not_import() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    found = []
    for c in contracts:
        if c["type"] != "forbidden":
            continue
        for source in c["source_modules"]:
            for path in _files(source):
                found += [f"{hit} ({c['name']})" for hit in _named(path, c["forbidden_modules"])]
    assert not found, "\n".join(found)
