"""Every package folder is listed in pyproject, and nothing installs bare top-level
``agent``/``collector``/``models``/``hook`` modules (training scripts have their own)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder_to_package() -> dict[Path, str]:
    mapping = {}
    for package, folder in SETUPTOOLS["package-dir"].items():
        mapping[(ROOT / folder).resolve()] = package
    return mapping


def test_every_package_folder_is_listed() -> None:
    roots = _folder_to_package()
    listed = set(SETUPTOOLS["packages"])
    found = set()
    for root, package in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join((package, *rel.parts)) if rel.parts else package)
    missing = found - listed
    assert not missing, f"package folders not listed in pyproject.toml: {sorted(missing)}"
    # Data folders (scenarios/, static/, data/, deploy/grafana/) are listed too, without an
    # __init__.py, so that setuptools ships their package data without a warning.
    stale = [p for p in listed - found if not _folder(p).is_dir()]
    assert not stale, f"pyproject.toml lists packages with no folder: {sorted(stale)}"


def _folder(package: str) -> Path:
    """The folder of ``package`` through package-dir's longest matching prefix."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        folder = SETUPTOOLS["package-dir"].get(".".join(parts[:n]))
        if folder is not None:
            return ROOT.joinpath(folder, *parts[n:])
    return ROOT.joinpath(*parts)


def test_nothing_installs_bare_top_level_parts() -> None:
    for package in SETUPTOOLS["packages"]:
        assert package == "forewarn" or package.startswith("forewarn."), package
    for package in SETUPTOOLS["package-dir"]:
        assert package.startswith("forewarn"), package


def test_installed_parts_import_under_forewarn() -> None:
    import importlib.util

    for part in ("agent", "collector", "models", "hook"):
        spec = importlib.util.find_spec(f"forewarn.{part}")
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).resolve().parent == (ROOT / part).resolve()
