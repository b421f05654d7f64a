"""Collector configuration: ``/etc/forewarn/collector.toml``, ``FOREWARN_COLLECTOR_*``, flags.

Loaded with :func:`forewarn.config.load_config` (``service="collector"``); field names are
the TOML keys. Unknown keys and bad values raise :class:`~forewarn.config.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from forewarn.config import ConfigError, check_logging

__all__ = ["DEFAULT_CONFIG_PATH", "CollectorConfig", "bus_password", "secret"]

DEFAULT_CONFIG_PATH = Path("/etc/forewarn/collector.toml")

SYNCHRONOUS = ("FULL", "NORMAL")
STATES = ("sqlite", "postgresql")


@dataclasses.dataclass(frozen=True)
class CollectorConfig:
    """Everything the collector service can be told. Field names are the TOML keys."""

    listen: str = "127.0.0.1:9404"
    """host:port of the HTTP API (ingest, commands, read API, /metrics)."""
    data_dir: Path = Path("/var/lib/forewarn-collector")
    """SQLite database (``collector.db``), staged batches (``staging/``), Parquet telemetry
    (``telemetry/``) and ``quarantine/`` (files set aside, never deleted by the collector):
    the unit's StateDirectory, the one place its dynamic user may write."""
    tokens_file: Path = Path("/var/lib/forewarn-collector/tokens.toml")
    """Per-agent tokens: TOML ``node = "sha256:<hex of token>"``; see ``token add``. In the
    state directory so that the service's dynamic user owns and can read it."""
    certfile: Path | None = None
    """TLS certificate (PEM); with ``keyfile`` the API is served over HTTPS only."""
    keyfile: Path | None = None
    """TLS private key (PEM) of ``certfile``."""
    api_token: str = ""
    """Bearer token required on the read API (empty = read API open; keep it on loopback)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest accepted ingest body (bytes, after any transfer decoding)."""
    max_batch_items: int = 20_000
    """Largest accepted length of each list (samples, xids, findings, ranks, checkpoints)."""
    ingest_max_age_s: float = 7 * 86400.0
    """Records timed more than this many seconds before the collector's clock are refused
    (a broken clock or unit; an agent spool replaying after a longer outage loses them)."""
    ingest_max_future_s: float = 300.0
    """Records timed more than this many seconds after the collector's clock are refused
    (a future sample would freeze its GPU's latest row); the skew metric shows why."""
    long_poll_max_s: float = 60.0
    """Upper bound of ``wait`` on ``GET /api/v1/commands``."""
    command_redeliver_s: float = 30.0
    """A delivered but unacknowledged command is delivered again after this many seconds."""
    command_ttl_s: float = 3600.0
    """A command never acknowledged expires (is no longer delivered) after this many seconds."""
    retention_days: int = 30
    """Days kept of everything the collector stores: telemetry (Parquet days), findings,
    XIDs, actions, decisions, checkpoints, commands and seen-batch records; nodes, GPUs,
    jobs and ranks that stopped reporting this long ago. Never pruned: staged samples, a
    node or job still reporting, an open finding (the newest of its check, not healthy)."""
    retention_interval_s: float = 3600.0
    """The running collector prunes (and compacts finished days) this often."""
    scrub_interval_s: float = 86400.0
    """Every Parquet file is read back in full this often; a damaged one is moved to
    ``<data_dir>/quarantine`` (metric ``quarantined_files_total{reason="damaged"}``)."""
    flush_interval_s: float = 10.0
    """Staged telemetry is compacted to Parquet at least this often ..."""
    flush_samples: int = 50_000
    """... or when this many samples are staged, and at shutdown. Smaller flushes keep
    ingest latency smooth (a flush is a burst of CPU); finished days are compacted."""
    sqlite_synchronous: str = "FULL"
    """SQLite ``synchronous``: FULL survives power loss, NORMAL survives a process crash."""
    group_commit_max: int = 256
    """Most ingest batches committed in one SQLite transaction (group commit)."""
    # -- scale-out state (forewarn.collector.storage.postgres; docs/scale.md) -------------
    state: str = "sqlite"
    """Where the collector's state lives: ``sqlite`` (embedded, ``<data_dir>/collector.db``)
    or ``postgresql`` (``postgres_dsn``; several replicas may share it)."""
    postgres_dsn: str = ""
    """libpq connection string or URI of the PostgreSQL database (``state = "postgresql"``),
    e.g. ``host=db1 dbname=forewarn user=forewarn``; keep a password out of it (use
    ``~/.pgpass`` or ``PGPASSFILE``)."""
    postgres_pool_max: int = 8
    """Most connections this replica opens to PostgreSQL."""
    # -- series to a Prometheus-compatible store (forewarn.collector.storage.remote_write) --
    remote_write_url: str = ""
    """Prometheus remote-write endpoint that receives the GPU series of every accepted
    sample (e.g. VictoriaMetrics ``http://vm:8428/api/v1/write``); empty = none."""
    remote_write_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Labels added to every series sent (e.g. ``{cluster = "a"}``, as Prometheus' scrape
    config would add)."""
    remote_write_queue_samples: int = 200_000
    """GPU samples held while the store is slow or down; past this new ones are dropped
    (``remote_write_dropped_samples_total{reason="queue_full"}``)."""
    remote_write_shards: int = 4
    """Remote-write requests in flight at once (one sender thread each; a series always
    goes through the same one, so its samples arrive in time order). A replica acknowledges
    batches no faster than the store takes these requests."""
    log_level: str = "info"
    """Logging level: critical, error, warning, info, debug."""
    log_format: str = "text"
    """Log lines: text (no timestamp under systemd's journal, which adds its own) or json
    (one JSON object per line)."""
    http: str = "auto"
    """uvicorn HTTP parser: auto (httptools when installed, the fast C one), httptools, h11."""
    # -- connection limits (forewarn.collector.http.connections) -------------------------------
    max_connections: int = 10_000
    """Most open HTTP connections. Lowered at start to the open-file limit less 128
    descriptors (database, Parquet, webhooks); the unit sets ``LimitNOFILE=65536``. At the
    limit a new connection closes the longest-idle one (no request in progress), or is
    refused with 503 when none is idle."""
    header_timeout_s: float = 10.0
    """A connection must send a complete request head within this many seconds of opening
    or of its previous response, else it is closed (slowloris; also the keep-alive idle
    limit: agents reuse a connection within 5 s)."""
    body_timeout_s: float = 60.0
    """A request body must arrive completely within this many seconds of its head."""
    log_every_s: float = 10.0
    """Log rate limit: one line per message kind per this many seconds, the next one
    saying how many were suppressed (0 = log everything)."""
    # -- policy and actions (forewarn.collector.decide.policy / actions / orders) -------------
    policy_shadow: bool = False
    """Global shadow mode: decisions are recorded, no action is taken."""
    policy_shadow_actions: tuple[str, ...] = ()
    """Action kinds (checkpoint, webhook, drain, hold) recorded only; drain is also shadow
    while ``drain_enabled`` is false."""
    policy_dedup_s: float = 300.0
    """The same check about the same subject within this window is one finding."""
    policy_cooldown_checkpoint_s: float = 600.0
    """No second checkpoint order for the same job within this many seconds."""
    policy_cooldown_webhook_s: float = 300.0
    """No second webhook about the same subject within this many seconds."""
    policy_cooldown_drain_s: float = 3600.0
    """No second drain of the same node within this many seconds."""
    policy_rate_checkpoint_per_min: float = 30.0
    """Most checkpoint orders per minute, fleet-wide."""
    policy_rate_webhook_per_min: float = 60.0
    """Most webhooks per minute, fleet-wide."""
    policy_rate_drain_per_min: float = 2.0
    """Most drains per minute, fleet-wide."""
    policy_breaker_checkpoint_share: float = 0.5
    """Circuit breaker: most of the jobs ordered to checkpoint within the window."""
    policy_breaker_drain_share: float = 0.1
    """Circuit breaker: most of the fleet's nodes drained within the window."""
    policy_breaker_window_s: float = 600.0
    """Window of the circuit breakers' shares, in seconds."""
    policy_probability: dict[str, float] = dataclasses.field(default_factory=dict)
    """P(failure within the hour) per check name, overriding the cost model's table."""
    policy_hold_checks: tuple[str, ...] = ("nan_loss",)
    """Checks whose unhealthy findings hold the job's saves (bad numerics: the ranks stop
    saving and mark checkpoints since the onset suspect); add ``grad_spike`` to treat a
    spike as poison too (the hook then saves nothing until ``Monitor.release_hold()``)."""
    checkpoint_default_s: float = 60.0
    """Checkpoint seconds assumed for a job before one of its checkpoints was measured."""
    order_delivery_latency_s: float = 0.5
    """Expected order delivery time (long poll) used to place the step S ahead."""
    order_safety_s: float = 2.0
    """Checkpoint order margin: seconds of step-time jitter added ahead of the fastest rank."""
    order_max_reissues: int = 3
    """A step S that a rank had already passed is reissued (later) at most this often."""
    webhook_urls: tuple[str, ...] = ()
    """Generic JSON webhooks, signed with ``webhook_secret`` (HMAC-SHA256)."""
    webhook_slack_urls: tuple[str, ...] = ()
    """Slack-compatible incoming webhooks (``text`` + ``blocks``)."""
    webhook_secret: str = ""
    """HMAC-SHA256 key of the generic webhooks (prefer webhook_secret_file)."""
    webhook_secret_file: Path | None = None
    """File holding webhook_secret."""
    webhook_max_attempts: int = 5
    """Attempts per webhook delivery before it is given up (and counted)."""
    webhook_backoff_s: float = 1.0
    """First retry delay of a webhook, doubled on each attempt."""
    drain_command: tuple[str, ...] = ()
    """Drain template as an argument list, e.g. ["kubectl", "cordon", "{node}"]; empty = none."""
    drain_enabled: bool = False
    """Run the drain command; off = shadow (record what would have run)."""
    drain_timeout_s: float = 30.0
    """Seconds the drain command may run before it is killed."""
    alert_token: str = ""
    """Bearer token of the Alertmanager/Grafana webhook routes (empty = routes refuse)."""
    alert_token_file: Path | None = None
    """File holding alert_token."""
    operator_token: str = ""
    """Bearer token of operator actions (``POST /api/v1/orders``, ``/api/v1/drains``);
    empty = those routes refuse. Must differ from ``api_token`` and ``alert_token``, and
    a node's token is never accepted for it."""
    operator_token_file: Path | None = None
    """File holding operator_token."""
    alert_ttl_s: float = 7200.0
    """A firing alert not re-sent within this long is forgotten (Alertmanager re-sends at
    ``repeat_interval``, 1 h in deploy/alertmanager.yml); the same labels firing again
    within it only update the alert's row: no new finding, no new decision."""
    alert_max_rows: int = 10_000
    """Most alerts (label sets) kept, in memory and in the ``alerts`` table; the least
    recently seen go first."""
    finding_ttl_s: float = 7200.0
    """A firing finding whose source went silent this long expires (its GPU's colour
    clears): for an agent's finding, no batch from its node; for an alert, no re-send (keep
    it above Alertmanager's ``repeat_interval``)."""
    incident_window_s: float = 300.0
    """Findings about one GPU (node, job) within this long of each other are one incident:
    one checkpoint order per job unless the incident escalates."""
    # -- failure predictor and goodput (forewarn.collector.decide.predict / goodput_service) ----
    predictor_enabled: bool = True
    """Run the failure predictor on live telemetry (the model loads at start)."""
    model_path: Path | None = None
    """A model file (skops, from ``forewarn models train``) instead of the current version
    of the model registry ``<data_dir>/models`` (``forewarn models retrain``; none yet: the
    shipped model)."""
    predict_interval_s: float = 10.0
    """Score every GPU (and refresh goodput advice) this often; a scoring that fails
    (counted in ``forewarn_collector_policy_errors_total``) is tried again after as long."""
    predict_sample_s: float = 10.0
    """Feed the predictor one sample per GPU per this many seconds (0 = every sample);
    features are per minute, so thinning 1 s samples changes no rate or mean."""
    predict_refresh_s: float = 300.0
    """An alarmed GPU's prediction is stored and passed to the policy again after this long
    (sooner when its health worsens)."""
    predict_threads: int = 1
    """OpenMP and BLAS threads a scoring may use. One: the model's OpenMP threads spin-wait
    for work and, on a host whose cores are busy, made a scoring several times slower."""
    goodput_gpu_mtbf_h: float = 24.0 * 1000.0 / 6.5 * 8
    """Per-GPU MTBF prior in hours for checkpoint interval advice (Meta, HPCA 2025: 6.5
    failures per 1,000 node-days of 8 GPUs), updated with the failures observed."""
    stragglers_enabled: bool = True
    """Compare the pace of every rank of each multi-GPU job across all its nodes and name
    stragglers, explained by their GPU's telemetry (forewarn.collector.decide.stragglers)."""
    straggler_bucket_s: float = 5.0
    """Time bucket of that comparison; a rank is named after 3 buckets in a row."""
    advise_hooks: bool = True
    """Send each job's advised checkpoint interval (as a step count) to its agents, which
    pass it to the ranks; hooks created with ``follow_advice=True`` then save at it (others
    ignore it). ``false`` (and ``policy_shadow``) keep the advice in the API and metrics
    only."""

    # -- NATS JetStream bus (forewarn.collector.ingest.bus; docs/scale.md) ----------------
    bus_url: str = ""
    """NATS server(s) to consume agents' batches from and send commands through
    (``nats://host:4222``, comma-separated for a cluster); empty = HTTP only."""
    bus_password: str = ""
    """Password of the collector's NATS user (``forewarn-collector``)."""
    bus_password_file: Path | None = None
    bus_ca_file: Path | None = None
    """PEM CA bundle that signed the NATS servers' TLS certificates."""
    bus_stream_max_age_s: float = 86400.0
    """Batches older than this leave the stream, consumed or not."""
    bus_stream_max_bytes: int = 10 * 1024**3
    """The stream keeps at most this many bytes of batches (the oldest go first)."""
    bus_stream_replicas: int = 1
    """JetStream replicas of the streams (3 on a 3-server cluster)."""
    bus_ack_wait_s: float = 10.0
    """A batch a replica took but did not acknowledge goes to another replica after this."""
    bus_fetch_max: int = 256
    """Batches one replica takes from the stream at a time."""

    def __post_init__(self) -> None:
        # Types are msgspec.convert's (forewarn.config); ranges and choices are the tables
        # below, checked in one place; the checks that relate keys follow.
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"listen: expected host:port, got {self.listen!r}")
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("certfile, keyfile: set both for TLS, or neither")
        _check_ranges(self)
        if self.state == "postgresql" and not self.postgres_dsn:
            raise ConfigError('postgres_dsn: required with state = "postgresql"')
        if self.remote_write_url and not self.remote_write_url.startswith(("http://",
                                                                          "https://")):
            from forewarn.redact import redact_url  # a config imports nothing else to load

            raise ConfigError(f"remote_write_url: expected an http(s) URL, got "
                              f"{redact_url(self.remote_write_url)!r}")
        check_logging(self.log_level, self.log_format)
        _check_policy_keys(self)
        _check_tokens_distinct(self)
        _check_bus_keys(self)

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def db_path(self) -> Path:
        return self.data_dir / "collector.db"

    @property
    def telemetry_dir(self) -> Path:
        return self.data_dir / "telemetry"

    @property
    def quarantine_dir(self) -> Path:
        """Agent batches the store could not hold, kept for the operator."""
        return self.data_dir / "quarantine" / "ingest"


def secret(value: str, path: Path | None, key: str) -> str:
    """``value``, else the contents of the file ``path`` (config key ``key``); a file that
    cannot be read is a :class:`ConfigError` naming the key."""
    if value or path is None:
        return value
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None


def bus_password(c: CollectorConfig) -> str:
    """The collector's NATS password: ``bus_password``, else ``bus_password_file``'s
    contents (:func:`secret`)."""
    return secret(c.bus_password, c.bus_password_file, "bus_password_file")


_POSITIVE = (
    "long_poll_max_s", "command_redeliver_s", "command_ttl_s", "flush_interval_s",
    "retention_interval_s", "scrub_interval_s", "ingest_max_age_s", "ingest_max_future_s",
    "finding_ttl_s", "incident_window_s", "alert_ttl_s", "predict_interval_s",
    "predict_refresh_s", "goodput_gpu_mtbf_h", "straggler_bucket_s",
)
"""Keys that must be above 0."""

_WITHIN: dict[str, tuple[float, float, str]] = {
    "max_body_bytes": (1024, 1024**3, "within 1024..2**30"),
    "max_batch_items": (1, 10_000_000, "within 1..10^7"),
    "retention_days": (1, math.inf, "at least 1"),
    "flush_samples": (1, math.inf, "at least 1"),
    "group_commit_max": (1, math.inf, "at least 1"),
    "postgres_pool_max": (1, 1000, "within 1..1000"),
    "remote_write_queue_samples": (1, 100_000_000, "within 1..10^8"),
    "remote_write_shards": (1, 64, "within 1..64"),
    "max_connections": (1, 1_000_000, "within 1..10^6"),
    "log_every_s": (0, 3600, "within 0..3600"),
    "alert_max_rows": (1, 10_000_000, "within 1..10^7"),
    "predict_sample_s": (0, math.inf, "at least 0"),
    "predict_threads": (1, 1024, "within 1..1024"),
}
"""Keys within ``lo..hi`` (inclusive), and how the error says it."""

_AT_MOST_AN_HOUR = ("header_timeout_s", "body_timeout_s")
"""Keys within (0, 3600] seconds."""

_CHOICES: dict[str, tuple[str, ...]] = {
    "sqlite_synchronous": SYNCHRONOUS,
    "state": STATES,
    "http": ("auto", "httptools", "h11"),
}
"""Keys that name one of a few choices (``sqlite_synchronous`` in any case)."""


def _check_ranges(c: CollectorConfig) -> None:
    """The tables above, the first bad key named in the error."""
    for key in _POSITIVE:
        if not getattr(c, key) > 0:
            raise ConfigError(f"{key}: must be positive, got {getattr(c, key)}")
    for key, (lo, hi, reads) in _WITHIN.items():
        if not lo <= getattr(c, key) <= hi:
            raise ConfigError(f"{key}: must be {reads}, got {getattr(c, key)}")
    for key in _AT_MOST_AN_HOUR:
        if not 0 < getattr(c, key) <= 3600:
            raise ConfigError(f"{key}: must be within (0, 3600], got {getattr(c, key)}")
    for key, choices in _CHOICES.items():
        value = getattr(c, key)
        if (value.upper() if key == "sqlite_synchronous" else value) not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")


def _check_bus_keys(c: CollectorConfig) -> None:
    """The NATS bus keys (only checked when ``bus_url`` is set)."""
    if not c.bus_url:
        return
    from forewarn.bus import check_url

    try:
        check_url("bus_url", c.bus_url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for key in ("bus_stream_max_age_s", "bus_ack_wait_s"):
        if not getattr(c, key) > 0:
            raise ConfigError(f"{key}: must be positive, got {getattr(c, key)}")
    if c.bus_stream_max_bytes < 1024**2:
        raise ConfigError(f"bus_stream_max_bytes: must be at least 1 MiB, got "
                          f"{c.bus_stream_max_bytes}")
    if c.bus_stream_replicas not in (1, 3, 5):
        raise ConfigError(f"bus_stream_replicas: must be 1, 3 or 5, got "
                          f"{c.bus_stream_replicas}")
    if not 1 <= c.bus_fetch_max <= 10_000:
        raise ConfigError(f"bus_fetch_max: must be within 1..10000, got {c.bus_fetch_max}")


def _check_tokens_distinct(c: CollectorConfig) -> None:
    """The operator, read and alert tokens are three different secrets (set in the config
    itself; tokens read from files are checked when the service reads them)."""
    named = [("operator_token", c.operator_token), ("api_token", c.api_token),
             ("alert_token", c.alert_token)]
    for i, (key, value) in enumerate(named):
        for other, value2 in named[i + 1:]:
            if value and value == value2:
                raise ConfigError(f"{key}, {other}: must be different tokens")


def _check_policy_keys(c: CollectorConfig) -> None:
    """Ranges of the policy and action keys (named in the error). Webhook URLs and the
    drain template are parsed, and refused, where they are used
    (:meth:`forewarn.collector.decide.policy_service.PolicyService.from_config`)."""
    kinds = ("checkpoint", "webhook", "drain", "hold")
    for kind in c.policy_shadow_actions:
        if kind not in kinds:
            raise ConfigError(f"policy_shadow_actions: unknown action {kind!r}")
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if f.name.startswith(("policy_", "order_", "webhook_", "drain_", "checkpoint_")) and (
            isinstance(value, float) and not value >= 0
        ):
            raise ConfigError(f"{f.name}: must not be negative, got {value}")
    for key in ("policy_breaker_checkpoint_share", "policy_breaker_drain_share"):
        if not 0 < getattr(c, key) <= 1:
            raise ConfigError(f"{key}: must be within (0, 1], got {getattr(c, key)}")
    for name, p in c.policy_probability.items():
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0 <= p <= 1:
            raise ConfigError(f"policy_probability: {name}: must be within 0..1, got {p!r}")
    if c.checkpoint_default_s <= 0 or c.drain_timeout_s <= 0:
        raise ConfigError("checkpoint_default_s, drain_timeout_s: must be positive")
    if not 1 <= c.webhook_max_attempts <= 100 or not 0 <= c.order_max_reissues <= 100:
        raise ConfigError("webhook_max_attempts (1..100), order_max_reissues (0..100)")
