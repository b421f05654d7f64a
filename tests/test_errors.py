"""Every exception forewarn defines derives from ForewarnError (one ``except`` for an
embedder), and nothing defines an error class that nothing raises."""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import forewarn
from forewarn.errors import ForewarnError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["agent", "collector", "deploy", "hook", "models", "src"]


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(forewarn.__path__, "forewarn."):
        if ".hook" in info.name or info.name.endswith("__main__"):
            continue  # the hook imports torch lazily; it defines no exceptions (checked below)
        names.append(info.name)
    return names


def test_every_forewarn_exception_has_the_one_root() -> None:
    strays = []
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # an optional extra that is not installed
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == name and not issubclass(obj, ForewarnError)
                    and not obj.__name__.startswith("_")):
                strays.append(f"{name}.{obj.__name__}")
    assert not strays, f"exceptions outside ForewarnError: {strays}"


def test_the_hook_defines_no_exception_of_its_own() -> None:
    text = "\n".join(p.read_text() for p in (ROOT / "hook").glob("*.py"))
    assert not re.search(r"^class \w+\(\w*(Error|Exception)\)", text, re.M)


def test_every_error_class_is_raised_somewhere() -> None:
    code = "\n".join(p.read_text() for d in SOURCES for p in (ROOT / d).rglob("*.py"))
    defined = re.findall(r"^class (\w+)\((?:[\w.]+, )*[\w.]*(?:Error|Exception|Unavailable)\w*[,)]",
                         code, re.M)
    never = [c for c in defined
             if c not in ("ForewarnError", "InputError", "StorageError", "UnavailableError")
             and not re.search(rf"raise {c}\b|raise \w+\.{c}\b|\({c}\)|{c}\(", code.replace(
                 f"class {c}(", ""))]
    assert not never, f"error classes nothing raises: {never}"
