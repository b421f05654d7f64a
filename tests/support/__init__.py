"""Helpers shared by several test files (importable as ``support``: pyproject.toml puts
``tests`` on ``sys.path`` through pytest's ``pythonpath`` option)."""
