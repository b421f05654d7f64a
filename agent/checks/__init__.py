"""Checks: one module each, all of them listed in :data:`ALL_CHECKS` (no import magic)."""
