"""The policy service's parts from :class:`~forewarn.collector.config.CollectorConfig`: the
policy thresholds (``policy_*`` keys), the actuators (webhook URLs and secret, the drain
template), the collector's own detectors, and the secrets read from their files.

A webhook URL or drain template the runtime module refuses is a
:class:`~forewarn.config.ConfigError` naming the key (checked here, where they are parsed,
not in the config module); so is a secret file that cannot be read (the CLI exits 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from forewarn.config import ConfigError

from ..config import secret
from .advisors import Advisors
from .alert_intake import AlertLimits
from .costmodel import CheckpointCostTracker
from .dispatch import ActionDispatch
from .drain import DrainError, DrainRunner, DrainTemplate
from .goodput_service import AdviceSender, GoodputService
from .ledger import FindingLedger
from .orders import OrderSettings
from .policy import PolicySettings
from .predict import PredictorService
from .stragglers import StragglerService
from .webhooks import WebhookEndpoint

if TYPE_CHECKING:
    from ..config import CollectorConfig

__all__ = ["action_dispatch", "advisors", "alert_limits", "ledger", "order_settings",
           "settings_from_config"]


def settings_from_config(config: CollectorConfig) -> PolicySettings:
    """The policy thresholds from the collector config's ``policy_*`` keys."""
    shadow_actions = set(config.policy_shadow_actions)
    if not config.drain_enabled:
        shadow_actions.add("drain")
    return PolicySettings(
        shadow=config.policy_shadow,
        shadow_actions=frozenset(shadow_actions),
        dedup_s=config.policy_dedup_s,
        cooldown_s={
            "checkpoint": config.policy_cooldown_checkpoint_s,
            "webhook": config.policy_cooldown_webhook_s,
            "drain": config.policy_cooldown_drain_s,
        },
        rate_per_minute={
            "checkpoint": config.policy_rate_checkpoint_per_min,
            "webhook": config.policy_rate_webhook_per_min,
            "drain": config.policy_rate_drain_per_min,
        },
        breaker_share={
            "checkpoint": config.policy_breaker_checkpoint_share,
            "drain": config.policy_breaker_drain_share,
        },
        breaker_window_s=config.policy_breaker_window_s,
        probability=dict(config.policy_probability),
        hold_checks=frozenset(config.policy_hold_checks),
    )


def order_settings(config: CollectorConfig) -> OrderSettings:
    """How checkpoint orders choose their step and are reissued (``order_*`` keys)."""
    return OrderSettings(delivery_latency_s=config.order_delivery_latency_s,
                         safety_s=config.order_safety_s,
                         max_reissues=config.order_max_reissues)


def _endpoints(key: str, urls: Sequence[str], fmt: str,
               signing: bytes = b"") -> list[WebhookEndpoint]:
    try:
        return [WebhookEndpoint(u, fmt, signing) for u in urls]
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def action_dispatch(config: CollectorConfig) -> ActionDispatch:
    """The webhook endpoints (signed with ``webhook_secret``) and the drain runner."""
    signing = secret(config.webhook_secret, config.webhook_secret_file,
                     "webhook_secret_file").encode()
    endpoints = (_endpoints("webhook_urls", config.webhook_urls, "json", signing)
                 + _endpoints("webhook_slack_urls", config.webhook_slack_urls, "slack"))
    drain = None
    if config.drain_command:
        try:
            template = DrainTemplate(config.drain_command)
        except DrainError as exc:
            raise ConfigError(f"drain_command: {exc}") from None
        drain = DrainRunner(template, enabled=config.drain_enabled,
                            timeout_s=config.drain_timeout_s)
    return ActionDispatch(endpoints, max_attempts=config.webhook_max_attempts,
                          backoff_s=config.webhook_backoff_s, drain=drain)


def advisors(config: CollectorConfig, tracker: CheckpointCostTracker) -> Advisors:
    """The predictor (unless ``predictor_enabled`` is off), goodput, the straggler
    detector, and the interval advice to hooks (never in shadow mode: it acts on
    nothing, so no advice reaches the ranks either)."""
    advise = config.advise_hooks and not config.policy_shadow
    return Advisors(
        tracker=tracker,
        predictor=PredictorService.from_config(config),
        goodput=GoodputService(checkpoint_default_s=config.checkpoint_default_s,
                               gpu_mtbf_h=config.goodput_gpu_mtbf_h),
        stragglers=StragglerService.from_config(config),
        advice=AdviceSender(order_settings(config)) if advise else None,
    )


def ledger(config: CollectorConfig) -> FindingLedger:
    """Incident tracking with ``finding_ttl_s`` and ``incident_window_s``."""
    return FindingLedger(ttl_s=config.finding_ttl_s, window_s=config.incident_window_s)


def alert_limits(config: CollectorConfig) -> AlertLimits:
    """How long alert rows live (``alert_ttl_s``, ``alert_max_rows``, ``retention_days``)."""
    return AlertLimits(ttl_s=config.alert_ttl_s, max_rows=config.alert_max_rows,
                       retention_s=config.retention_days * 86400.0)
