"""Where things are, for tests in any folder under tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""The tests/ folder (shared data: data/, golden/, fake_nvml/, the worker scripts)."""
REPO = TESTS.parent
"""The repository root."""
