"""The policy seam of ``create_app`` (collector/decide/seam.py): each optional hook is a small
Protocol, and the collector's own policy implements every one of them, so a renamed hook
method fails here instead of silently switching that hook off. The seam is typed below the
HTTP layer: the policy hands the HTTP layer plain callables and never builds a route."""

from __future__ import annotations

import re

from forewarn.collector.decide.policy_service import PolicyService
from forewarn.collector.decide.seam import (
    AckHook,
    ApiHook,
    BatchHook,
    FeedHook,
    FindingsPolicy,
    StartHook,
    StopHook,
)

from support.paths import REPO

HOOKS = (StartHook, StopHook, BatchHook, AckHook, FeedHook, ApiHook)


def test_the_collector_policy_implements_every_hook() -> None:
    missing = [hook.__name__ for hook in HOOKS if not issubclass(PolicyService, hook)]
    assert not missing, f"PolicyService lacks the hook method of {missing}"


def test_a_hook_set_to_none_is_absent() -> None:
    class OnlyFindings:
        on_batches = None

        def on_findings(self, findings: object, store: object, now: float) -> None:
            return None

    policy: FindingsPolicy = OnlyFindings()
    assert not any(isinstance(policy, hook) for hook in HOOKS)


def test_only_the_http_layer_imports_starlette() -> None:
    below = [p.relative_to(REPO).as_posix()
             for layer in ("decide", "ingest", "jobs", "storage")
             for p in sorted((REPO / "collector" / layer).rglob("*.py"))
             if re.search(r"^\s*(from|import) starlette", p.read_text(), re.MULTILINE)]
    assert not below, f"starlette below collector/http: {below}"
