"""Which optional extra provides a third-party module, so that a command run without it
says what to install in one line instead of a traceback.

``forewarn`` itself needs only msgspec; each part's dependencies come with an extra
(pyproject's ``[project.optional-dependencies]``). :func:`missing_extra` turns the
:class:`ModuleNotFoundError` of such a module into that line; the ``forewarn`` command
prints it and exits 2 (a configuration error: restarting will not fix it).
"""

from __future__ import annotations

__all__ = ["EXTRA_OF", "missing_extra"]

# Top-level module -> extra that installs it (pyproject.toml). torch is not in any extra:
# the user picks the build (CPU or CUDA) that fits the machine.
EXTRA_OF: dict[str, str | None] = {
    "pynvml": "agent",
    "prometheus_client": "agent",
    "httpx": "agent",
    "starlette": "collector",
    "uvicorn": "collector",
    "httptools": "collector",
    "numpy": "models",
    "pandas": "models",
    "pyarrow": "models",
    "sklearn": "models",
    "skops": "models",
    "matplotlib": "models",
    "rich": "demo",
    "grafana_client": "grafana",
    "grafana_foundation_sdk": "grafana",
    "torch": None,
}


def missing_extra(exc: ImportError, command: str) -> str | None:
    """The line telling what to install for ``command`` when ``exc`` is the import error
    of a module an extra (or torch) provides; ``None`` for any other import error."""
    module = (exc.name or "").partition(".")[0]
    if module not in EXTRA_OF:
        return None
    extra = EXTRA_OF[module]
    if extra is None:
        return f"{command} needs {module}, which is not installed: pip install {module}"
    return (f"{command} needs {module}, which is not installed: "
            f"pip install 'forewarn[{extra}]'")
