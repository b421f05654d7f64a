"""The live failure predictor inside the collector, with shadow scoring.

:class:`PredictorService` holds a :class:`~forewarn.models.live.LiveScorer` around the
model the collector loads at start (the shipped default, or the operator's retrained skops
file from ``model_path``).

Without ``model_path`` the model (the registry's current one, else the shipped one) loads
on a thread of its own (:meth:`PredictorService.load_default`): importing the model stack
(scikit-learn, skops, and through them torch) takes seconds, up to half a minute on a
loaded machine, and the collector serves ``/healthz`` and ingest meanwhile; ``/readyz``
reports the ``predictor`` component not ready until the model is in
(:meth:`PredictorService.readiness`). Samples offered before that are counted as
``loading`` and not kept. An operator's ``model_path`` is loaded before serving, so a file
that is not a model stops the start with an error naming the key.

The registry is followed while the collector runs (:mod:`.model_watch`): a promotion
(``forewarn models retrain``) or a rollback is noticed at the next scoring, the new
version loads in the background while the running one goes on scoring, and the scorings
after it is in use it. The scorer's state (an hour of telemetry, every GPU's own baseline,
alarm memory, shadow counts) carries over. ``/readyz`` and ``/api/v1/risk`` name the
version that runs. A fixed ``model_path`` is not followed.

:class:`~forewarn.collector.decide.policy_service.PolicyService` drives it from the policy
thread:

* :meth:`PredictorService.observe` takes every stored batch's samples and XIDs. One sample
  per GPU per ``predict_sample_s`` is fed (features live on a 60 s grid of cumulative
  counters and gauge sums, so fewer samples change neither counter rates nor the gauge
  means; the shipped model was trained on 60 s samples). A sample reporting the GPU not
  OK, and every XID, is always fed: those are the failures shadow scoring counts.
* :meth:`PredictorService.score` runs every ``predict_interval_s``: all GPUs at once
  (vectorised features, the probabilities in chunks; the policy runs it as
  :meth:`~PredictorService.score_parts`, in parts between which urgent work runs),
  returning the findings to pass to the policy: GPUs at or above the model's threshold
  (only those are actionable; they carry ``probability`` and ``horizon_s``, so the
  cost-aware checkpoint decision uses P). An alarmed GPU's finding is passed on again only
  after ``predict_refresh_s`` or when its health worsens (the policy would drop it as a
  duplicate anyway).
* The same scoring compares every GPU with the other GPUs of its job
  (:mod:`forewarn.models.job_peers`; which job a GPU runs comes from the batches' rank
  summaries): ``models.job_peers`` findings, passed on alike.

Metrics (registered on the collector's registry, rendered from the last scoring):
``forewarn_gpu_failure_score{node,gpu}`` (the alarm score, every GPU scored; the threshold
applies to it) and ``forewarn_gpu_failure_probability{node,gpu}`` (P, see :mod:`.risk`),
``forewarn_collector_prediction_precision``, ``..._recall``, ``..._lead_seconds`` (median
lead; NaN until defined), counters ``forewarn_collector_prediction_{alarms,true_alarms,
false_alarms,failures,caught}_total``, ``..._open_alarms``, and the predictor's own
``forewarn_collector_predictor_{up,gpus,score_seconds,threshold,horizon_seconds}``,
``forewarn_collector_predictor_samples_total{result}`` (fed, thinned, error, loading).

Route: ``GET /api/v1/risk`` (``node``, ``min``, ``limit``): the model, the latest score
and probability per GPU (highest score first) and per job (its highest-scoring GPU's).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.registry import CollectorRegistry
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from forewarn.config import ConfigError
from forewarn.wire import AgentBatch, Finding, GpuState, Health

from .risk import RiskScores, empty_scores, gpu_risk, job_risk_entry
from .scoring_pass import run_whole

if TYPE_CHECKING:
    from forewarn.models.alarms import ShadowStats
    from forewarn.models.live import LiveScorer
    from forewarn.models.predictor import FailurePredictor

    from ..config import CollectorConfig
    from .drift import LiveDrift
    from .model_watch import RegistryWatch
    from .scorer_state import ScorerSnapshots
    from .seam import DecideContext, RiskQuery

__all__ = ["SCORE_CHUNK", "PredictorService", "RiskScores", "load_predictor_model"]

log = logging.getLogger(__name__)


SCORE_CHUNK = 2048
"""GPUs whose probabilities one part of a scoring computes (urgent work runs between)."""

DEFAULT_GPU_MTBF_H = 24.0 * 1000.0 / 6.5 * 8
"""Per-GPU MTBF prior (hours): 6.5 failures per 1,000 node-days of 8 GPUs (Meta, HPCA 2025,
docs/reference.md); same figure as :data:`forewarn.collector.jobs.goodput.DEFAULT_GPU_MTBF_H`."""


_DONE = object()
"""What ``next`` gives for a scoring's parts once they are all done."""


def load_predictor_model(model_path: Path | None, registry: Path
                         ) -> tuple[FailurePredictor, str]:
    """The operator's model (``model_path``), else the current version of the model
    registry in ``registry`` (:mod:`forewarn.models.registry`; none yet: the shipped
    model), and where it came from (``default``, ``registry vN``, the path). Raises
    :class:`~forewarn.models.persist.ModelError` (untrusted types, not a model),
    :class:`~forewarn.models.registry.RegistryError` or ``OSError``."""
    from forewarn.models.persist import load_model

    from .model_watch import RegistryWatch

    if model_path is not None:
        return load_model(model_path), str(model_path)
    return RegistryWatch(registry).load()


@dataclasses.dataclass
class _Recorder:
    """The scores and probabilities of every live GPU of the last scoring."""

    last: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    """nodes, gpus, scores and P (NaN without a calibration): :class:`RiskScores`."""


def _recording(model: FailurePredictor, rec: _Recorder) -> FailurePredictor:
    """The model, made to hand ``rec`` the scores and probabilities of every GPU it is
    asked to turn into findings (:meth:`LiveScorer.score` passes it all live GPUs at
    once)."""
    from forewarn.models.predictor import FailurePredictor

    class RecordingPredictor(FailurePredictor):
        def findings(self, nodes: np.ndarray, gpus: np.ndarray, probs: np.ndarray,
                     now: float, evidence: dict[str, np.ndarray] | None = None,
                     alarm: np.ndarray | None = None) -> list[Finding]:
            p = self.failure_probability(probs)
            rec.last = (nodes, gpus, probs, np.full(len(probs), np.nan) if p is None
                        else np.clip(p, 0.0, 1.0))
            # The scorer's alarm episodes and explanations go into the findings as they are.
            return super().findings(nodes, gpus, probs, now, evidence, alarm)

    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    return RecordingPredictor(**fields)


class PredictorService:
    """See the module docstring. Not thread-safe: call from the policy thread, except
    :attr:`scores` (an immutable snapshot) and the metrics collector."""

    def __init__(
        self,
        model: FailurePredictor | None,
        *,
        interval_s: float = 10.0,
        sample_s: float = 10.0,
        refresh_s: float = 300.0,
        source: str = "default",
        error: str = "",
        gpu_mtbf_h: float = DEFAULT_GPU_MTBF_H,
        threads: int = 1,
    ) -> None:
        self.interval_s = interval_s
        self.threads = threads
        self.sample_s = sample_s
        self.refresh_s = refresh_s
        self.source = source
        self.error = error
        self.gpu_mtbf_h = gpu_mtbf_h
        self._rec = _Recorder()
        self.model: FailurePredictor | None = None
        self.scorer: LiveScorer | None = None
        self.drift: LiveDrift | None = None
        self.loading = False
        """The model is loading (:meth:`load_default`)."""
        self.watch: RegistryWatch | None = None
        """The model registry followed (None: a fixed ``model_path``)."""
        if model is not None:
            self._install(model)
        self.scores = empty_scores(0.0)
        self.shadow_stats: ShadowStats | None = None
        self.last_score: float | None = None
        self._last_pass: float | None = None
        """When the last scoring began, whether or not it scored: one that fails waits the
        interval too, not every telemetry batch (the failure is counted by the pass)."""
        self.score_seconds = 0.0
        self.gpu_seconds = 0.0
        """GPU-seconds observed (scored GPUs x time between scorings): the exposure the
        fleet's failure rate is measured over."""
        self.samples = {"fed": 0, "thinned": 0, "error": 0, "loading": 0}
        self._fed: dict[tuple[str, int], float] = {}
        self._submitted: dict[tuple[str, str, int], tuple[float, Health]] = {}
        self.snapshots: ScorerSnapshots | None = None
        """Where the scorer's learned state is kept (:mod:`.scorer_state`; None: nowhere)."""
        self._clock: Callable[[], float] = time.time
        self._restore = False
        self._own: float | None = None
        """The end of what the scorer held when this replica started to lead."""

    @classmethod
    def from_config(cls, config: CollectorConfig) -> PredictorService | None:
        """``None`` when ``predictor_enabled`` is off. A ``model_path`` that cannot be
        loaded is a :class:`~forewarn.config.ConfigError` naming the key. Without one, the
        registry's (or the shipped) model loads in the background (:meth:`load_default`);
        one that cannot be loaded is logged and leaves the predictor off (``..._up 0``,
        ``/readyz`` not ready)."""
        if not config.predictor_enabled:
            return None
        kw: dict[str, Any] = {"interval_s": config.predict_interval_s,
                              "sample_s": config.predict_sample_s,
                              "refresh_s": config.predict_refresh_s,
                              "threads": config.predict_threads,
                              "gpu_mtbf_h": config.goodput_gpu_mtbf_h}
        if config.model_path is None:
            svc = cls(None, **kw)
            svc.load_default(config.data_dir / "models")
            return svc
        from forewarn.models.persist import ModelError
        from forewarn.models.registry import RegistryError

        try:
            model, source = load_predictor_model(config.model_path, config.data_dir / "models")
        except (ModelError, RegistryError, OSError) as exc:
            raise ConfigError(f"model_path: {exc}") from None
        return cls(model, source=source, **kw)

    def load_default(self, registry: Path) -> threading.Thread:
        """Load the model registry's current model (none yet: the shipped one) on a daemon
        thread (returned); until it is in, the predictor scores nothing and
        :meth:`readiness` says it is loading."""
        from .model_watch import RegistryWatch

        self.loading = True
        self.watch = RegistryWatch(registry)
        thread = threading.Thread(target=self._load_default, args=(self.watch,),
                                  name="forewarn-model-load", daemon=True)
        thread.start()
        return thread

    def _load_default(self, watch: RegistryWatch) -> None:
        try:
            model, self.source = watch.load()
            self._install(model)
        except Exception as exc:  # ModelError, RegistryError, OSError, a broken model stack
            self.error = str(exc) or type(exc).__name__
            log.error("failure predictor off: the model could not be loaded: %s", self.error)
        finally:
            self.loading = False

    def _install(self, model: FailurePredictor) -> None:
        """Run ``model``: in a new scorer at start, in the running one (its state kept)
        when the registry moved on."""
        from forewarn.models.live import LiveScorer

        from .drift import LiveDrift  # pandas, through forewarn.models.drift

        # Built whole, then published scorer last: the policy thread reads ``scorer``
        # first and only then uses ``model`` (one handoff from the loading thread).
        recording = _recording(model, self._rec)
        ref = model.metadata.get("reference")
        self.drift = LiveDrift(ref, model.feature_names) if ref else None
        self.model = recording
        if self.scorer is not None:  # the policy thread, between scorings
            self.scorer.model = recording
        else:
            self.scorer = LiveScorer(recording)
        log.info("failure predictor: model %s (horizon %.0f s, threshold %.2f)", self.source,
                 model.horizon_s, model.threshold)

    def readiness(self) -> dict[str, Any]:
        """The ``predictor`` component of ``/readyz``: ready once a model is loaded."""
        if self.scorer is not None:
            note, watch = "", self.watch
            if watch is not None and watch.loading:
                note = "; reading the model registry"
            elif watch is not None and watch.error:
                note = f"; the registry's current version did not load: {watch.error}"
            return {"ready": True, "detail": f"model {self.source}{note}"}
        if self.loading:
            return {"ready": False, "detail": "loading the failure model"}
        return {"ready": False, "detail": f"no failure model: {self.error or 'not loaded'}"}

    # -- policy thread ---------------------------------------------------------------

    def keep_state(self, snapshots: ScorerSnapshots, clock: Callable[[], float]) -> None:
        """Save the scorer's learned state through ``snapshots`` (:meth:`save_state`) and
        restore it from there when this replica starts to lead (:meth:`take_over`)."""
        self.snapshots, self._clock = snapshots, clock

    def take_over(self) -> None:
        """This replica starts to lead (at start too): the stored state goes into the
        scorer before it sees the next batch (once the model is in)."""
        from forewarn.models.live_state import held_until

        self._restore = self.snapshots is not None
        self._own = None if self.scorer is None else held_until(self.scorer)

    def _restored(self) -> LiveScorer | None:
        """The scorer, with the stored state put in first when a takeover asked for it
        (again at the next batch while the store cannot be read: what the scorer learns
        meanwhile is replaced, the row is never saved over unread)."""
        scorer = self.scorer
        if self._restore and scorer is not None and self.snapshots is not None:
            self._restore = self.snapshots.load(scorer, self._clock(), self._own) is None
        return scorer

    def save_state(self, now: float, *, wait: bool = False) -> None:
        """Save the scorer's state when a save is due (``wait``: now, written before
        returning). Leader only; never while a takeover's restore is still to come (an
        empty scorer would replace the state it is to restore)."""
        snaps, scorer = self.snapshots, self.scorer
        if snaps is not None and scorer is not None and not self._restore \
                and (wait or snaps.due(now)):
            snaps.save(scorer, now, wait=wait)

    def observe(self, batches: Sequence[AgentBatch]) -> None:
        """Feed the batches' samples (thinned per GPU) and XIDs to the scorer."""
        scorer = self._restored()
        if scorer is None:
            if self.loading:
                self.samples["loading"] += sum(len(b.samples) for b in batches)
            return
        fed, thin, counts = self._fed, self.sample_s, self.samples
        for b in batches:
            for s in b.samples:
                key = (s.node, s.gpu)
                if thin > 0 and s.state == GpuState.OK:
                    last = fed.get(key)
                    if last is not None and 0.0 <= s.time - last < thin:
                        counts["thinned"] += 1
                        continue
                fed[key] = s.time
                try:
                    scorer.observe(s)
                    counts["fed"] += 1
                except Exception:  # bad data never stops the collector
                    counts["error"] += 1
                    if counts["error"] <= 10:
                        log.exception("predictor: sample of %s GPU %s refused", s.node, s.gpu)
            for x in b.xids:
                try:
                    scorer.observe_xid(x)
                except Exception:
                    counts["error"] += 1
            for r in b.ranks:  # which job each GPU runs: its job peers
                if r.gpu is not None:
                    scorer.assign_job(r.node, r.gpu, r.job, b.created)

    def due(self, now: float) -> bool:
        """Whether a scoring is due at ``now``: ``interval_s`` after the last one began
        (one that failed included)."""
        last = self._last_pass
        return self.scorer is not None and (
            last is None or now - last >= self.interval_s or now < last)

    def score(self, now: float) -> list[Finding]:
        """Score every live GPU; return the findings to pass to the policy now."""
        return self.to_submit(run_whole(self.score_parts(now)), now)

    def score_parts(self, now: float) -> Generator[None, None, list[Finding]]:
        """:meth:`score` in parts, a ``yield`` between them (:mod:`.scoring_pass`): the
        features of every GPU, the probabilities :data:`SCORE_CHUNK` GPUs at a time, then
        the findings; this scoring is published (shadow counts, then scores) in the last.
        Returns every alarmed GPU's finding: :meth:`to_submit` picks those to pass on, when
        they are passed on (a replica that stepped down meanwhile passes none on)."""
        if self.scorer is not None and self.watch is not None:
            got = self.watch.poll()  # one stat: the registry may have moved on
            if got is not None:
                self.source = got[1]
                self._install(got[0])
        scorer, model = self._restored(), self.model
        if scorer is None or model is None:
            return []
        self._last_pass = now
        before, spent = scorer.computed, 0.0
        started = time.perf_counter()
        parts = scorer.prepare(now, SCORE_CHUNK)
        # predict_threads (1): OpenMP threads spin-wait for work, slow on a busy host; the
        # limit is set for each part, not across the urgent work run between them
        while True:
            with threadpool_limits(limits=self.threads):
                if next(parts, _DONE) is _DONE:
                    break
            spent += time.perf_counter() - started
            yield
            started = time.perf_counter()
        self._rec.last = None
        with threadpool_limits(limits=self.threads):
            findings = scorer.score(now)
            last = self._rec.last
            findings += scorer.job_findings(now)
        computed = scorer.computed
        if self.drift is not None and computed is not None and computed is not before:
            self.drift.update(computed.matrix, now)
        scores = RiskScores(now, *last) if last is not None else empty_scores(now)
        if self.last_score is not None and now > self.last_score:
            # exposure for the fleet's failure rate; a long pause counts as one stale window
            self.gpu_seconds += len(scores.scores) * min(now - self.last_score, scorer.stale_s)
        # the shadow counts first: a reader that sees this scoring's risk (its time) sees
        # the failures it counted too (CI at 7c1ac98 read the risk, then the old counts)
        self.shadow_stats = scorer.shadow()
        self.scores = scores
        self.last_score = now
        self.score_seconds = spent + time.perf_counter() - started  # its parts, not the gaps
        return findings

    def to_submit(self, findings: list[Finding], now: float) -> list[Finding]:
        """The ``findings`` of a scoring to pass to the policy now (the module docstring:
        new, refreshed after ``predict_refresh_s``, or worse); they count as passed on."""
        out = []
        for f in findings:
            key = (f.check, f.subject.node, f.subject.gpu or 0)
            seen = self._submitted.get(key)
            if (seen is None or now - seen[0] >= self.refresh_s or now < seen[0]
                    or f.health.severity > seen[1].severity):
                self._submitted[key] = (now, f.health)
                out.append(f)
        if len(self._submitted) > 10_000:
            self._submitted = {k: v for k, v in self._submitted.items()
                               if now - v[0] < self.refresh_s}
        return out

    def fleet_gpu_mtbf_h(self) -> float:
        """Per-GPU MTBF in hours: the prior (:attr:`gpu_mtbf_h`, worth one failure) updated
        with the failures and GPU-hours observed (the mean of a gamma posterior)."""
        failures = self.shadow_stats.failures if self.shadow_stats is not None else 0
        return (self.gpu_mtbf_h + self.gpu_seconds / 3600.0) / (1.0 + failures)

    @property
    def horizon_s(self) -> float:
        return self.model.horizon_s if self.model is not None else 3600.0

    # -- API ---------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        """What the API says about the model."""
        m = self.model
        if m is None:
            return {"loaded": False, "loading": self.loading, "error": self.error}
        return {"loaded": True, "source": self.source, "horizon_s": m.horizon_s,
                "threshold": m.threshold, "check": m.check_name,
                "trained_at": m.metadata.get("trained_at")}

    def risk(self, ctx: DecideContext, query: RiskQuery, now: float) -> dict[str, Any]:
        """Latest score and failure probability per GPU and per job (``GET /api/v1/risk``,
        :mod:`.risk`)."""
        sc = self.scores
        threshold = self.model.threshold if self.model is not None else math.inf
        jobs = []
        for row in ctx.store.query("SELECT DISTINCT job FROM ranks ORDER BY job"):
            info = ctx.jobs.job(str(row["job"]))
            if info is not None:
                jobs.append(job_risk_entry(sc, info, threshold))
        return {"model": self.model_info(), "time": sc.time if self.last_score else None,
                "scored": len(sc.scores), "gpus": gpu_risk(sc, query), "jobs": jobs}

    # -- metrics -----------------------------------------------------------------------

    def register(self, registry: CollectorRegistry) -> None:
        """Add the predictor's metrics to ``registry``."""
        from .predict_metrics import PredictorMetrics

        registry.register(PredictorMetrics(self))
