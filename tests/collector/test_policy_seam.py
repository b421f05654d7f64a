"""The policy seam of ``create_app`` (collector/http/app.py): each optional hook is a small
Protocol, and the collector's own policy implements every one of them, so a renamed hook
method fails here instead of silently switching that hook off."""

from __future__ import annotations

from forewarn.collector.decide.policy_service import PolicyService
from forewarn.collector.http.app import (
    AckHook,
    BatchHook,
    FindingsPolicy,
    RouteHook,
    StartHook,
    StopHook,
)

HOOKS = (StartHook, StopHook, BatchHook, AckHook, RouteHook)


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
