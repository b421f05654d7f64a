"""Every third-party module that ``forewarn.models`` imports is declared in the
``forewarn[models]`` extra: an operator who installs that extra can run every
``forewarn models`` command (a module that merely comes along with another package today,
as threadpoolctl comes with scikit-learn, may not tomorrow)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imported_modules(folder: Path) -> set[str]:
    """Top-level names of every module imported anywhere in ``folder``'s Python files
    (function-level imports too)."""
    out: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
    return out


def _declared(extra: str) -> set[str]:
    """Distribution names the extra requires, extras it includes expanded."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names: set[str] = set()
    todo = [*extras[extra], *project["dependencies"]]
    while todo:
        req = todo.pop()
        name = re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0]
        if name == "forewarn":
            inner = re.search(r"\[(.*)\]", req)
            todo += [r for e in (inner.group(1).split(",") if inner else ())
                     for r in extras[e.strip()]]
        else:
            names.add(name.lower().replace("_", "-"))
    return names


def test_every_third_party_module_models_import_is_in_the_models_extra() -> None:
    dists = importlib.metadata.packages_distributions()
    third_party = {m for m in _imported_modules(REPO / "models")
                   if m not in sys.stdlib_module_names and m not in ("forewarn", "__future__")}
    declared = _declared("models")
    missing = {m: dists.get(m, [m]) for m in third_party
               if not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & declared}
    assert not missing, f"imported by forewarn.models but not in forewarn[models]: {missing}"
