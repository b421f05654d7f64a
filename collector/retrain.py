"""``forewarn models retrain|drift|versions|rollback``: learn from the fleet's own store.

These actions of ``forewarn models`` live with the collector because they read its store
(:mod:`forewarn.collector.storage.history`), which :mod:`forewarn.models` may not import.
The store is the collector's, found as the collector finds it (``--config``, the
``FOREWARN_COLLECTOR_*`` environment, ``--data-dir``, ``--state``, ``--postgres-dsn``), or
an export in the replay format (``--data DIR``: samples, XIDs, optional ``labels.csv``).
The model registry is ``<data_dir>/models`` (``--registry`` to choose another); the
running collector switches to its current version at its next scoring (it follows the
registry: :mod:`forewarn.collector.decide.model_watch`).

``retrain``   train a candidate of the kind that ships (``rules_forest``; ``--detector
              model`` for the gradient-boosted one), judge it in shadow against the
              running model, promote or refuse it (:mod:`forewarn.models.retrain`,
              :mod:`forewarn.models.gate`)
``drift``     PSI per feature, the last days of the store against the running model's
              training distribution (:mod:`forewarn.models.drift`)
``versions``  the registry's versions and every decision
``rollback``  run an earlier version (0: the shipped model)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["register_actions"]

_STORE_KEYS = ("data_dir", "state", "postgres_dsn")


def register_actions(ms: Any) -> None:
    """Add the actions above to ``forewarn models`` (its subparsers ``ms``)."""
    from forewarn.models.train import DETECTORS, SHIPPED_DETECTOR

    r = ms.add_parser("retrain", help="train a candidate on the collector's store; promote "
                      "it only when it beats the running model in shadow",
                      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _store_arguments(r)
    r.add_argument("--shadow-days", type=float, default=7.0,
                   help="judge on the last N days; train on what came before (default 7)")
    r.add_argument("--min-failures", type=int, default=3,
                   help="failures the shadow window must hold to judge (default 3)")
    r.add_argument("--detector", choices=DETECTORS, default=SHIPPED_DETECTOR,
                   help="the candidate's kind: rules_forest (shipped; its isolation forest "
                   "refitted on the fleet's rows, its cutoff tuned on the fleet's held-out "
                   "GPUs) or model (gradient-boosted; docs/models.md)")
    r.add_argument("--threshold", type=float,
                   help="candidate's threshold (default: rules_forest 0.5, model tuned)")
    r.add_argument("--target-false-alarms", type=float, default=0.5,
                   help="false alarms per 1,000 GPU-days the tuned cutoff or threshold "
                   "aims under")
    r.add_argument("--max-iter", type=int, default=150,
                   help="boosting iterations (--detector model)")
    r.add_argument("--threads", type=int, default=1, help="OpenMP/BLAS threads (default 1)")
    r.set_defaults(func=_retrain)
    d = ms.add_parser("drift", help="feature drift: the store's last days against the "
                      "running model's training distribution (PSI per feature)")
    _store_arguments(d)
    d.add_argument("--days", type=float, default=1.0, help="the last N days (default 1)")
    d.add_argument("--top", type=int, default=15, help="features to list")
    d.set_defaults(func=_drift)
    v = ms.add_parser("versions", help="the model registry: versions and decisions")
    _store_arguments(v, data=False)
    v.set_defaults(func=_versions)
    b = ms.add_parser("rollback", help="run an earlier model version (0: the shipped model)")
    b.add_argument("version", type=int)
    b.add_argument("--reason", default="", help="recorded with the decision")
    _store_arguments(b, data=False)
    b.set_defaults(func=_rollback)


def _store_arguments(p: argparse.ArgumentParser, data: bool = True) -> None:
    from forewarn.config import add_config_arguments

    from .config import CollectorConfig

    add_config_arguments(p, CollectorConfig, service="collector", only=_STORE_KEYS)
    p.add_argument("--registry", type=Path,
                   help="model registry directory (default <data_dir>/models)")
    if data:
        p.add_argument("--data", help="an export in the replay format instead of the store")


def _config(args: argparse.Namespace) -> Any:
    """The collector's configuration, found as the collector finds it."""
    from forewarn.config import load_from_args

    from .config import DEFAULT_CONFIG_PATH, CollectorConfig

    return load_from_args(CollectorConfig, service="collector", args=args,
                          default_path=DEFAULT_CONFIG_PATH)


def _registry(args: argparse.Namespace) -> Any:
    from forewarn.models.registry import ModelRegistry

    if args.registry is not None:
        return ModelRegistry(args.registry)
    return ModelRegistry(_config(args).data_dir / "models")


def _history(args: argparse.Namespace, start: float = 0.0) -> tuple[Any, Any, Any]:
    """(samples, xids, outcomes) from ``--data`` or the collector's store."""
    if args.data:
        from forewarn.models.cli import load_dir

        samples, xids, labels = load_dir(args.data)
        return samples, xids, labels
    from .metrics import CollectorMetrics
    from .storage.datadir import telemetry_replica
    from .storage.history import read_history
    from .storage.state import open_state
    from .storage.telemetry import TelemetryWriter

    config = _config(args)
    store = open_state(config)
    try:
        tel = TelemetryWriter(store, config.telemetry_dir, CollectorMetrics(),
                              replica=telemetry_replica(config))
        h = read_history(store, tel, start=start)
    finally:
        store.close()
    return h.samples, h.xids, h.drains


def _fail(action: str, exc: BaseException) -> int:
    print(f"forewarn models {action}: {exc}", file=sys.stderr)
    return 2


def _drift_lines(drift: dict[str, float], top: int) -> list[str]:
    from forewarn.models.drift import DRIFTED

    ranked = sorted(drift.items(), key=lambda kv: -kv[1])
    lines = [f"feature drift (PSI; > {DRIFTED:g} drifted): "
             f"{sum(v > DRIFTED for v in drift.values())} of {len(drift)} features drifted"]
    lines += [f"  {name:<32} {v:8.3f}{'  DRIFTED' if v > DRIFTED else ''}"
              for name, v in ranked[:top]]
    return lines


def _retrain(args: argparse.Namespace) -> int:
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    from forewarn.errors import InputError
    from forewarn.models.retrain import retrain

    try:
        registry = _registry(args)
        samples, xids, outcomes = _history(args)
        with threadpool_limits(args.threads):
            res = retrain(samples, xids, outcomes, registry, shadow_days=args.shadow_days,
                          min_failures=args.min_failures, detector=args.detector,
                          threshold=args.threshold,
                          target_false_alarms=args.target_false_alarms,
                          max_iter=args.max_iter)
    except (InputError, OSError) as exc:  # RetrainError, DataError, ModelError, ...
        return _fail("retrain", exc)
    v = res.verdict
    print(f"candidate version {res.version} ({args.detector}): "
          f"{'PROMOTED' if v.promote else 'REFUSED'} "
          f"against version {res.running_version}: {v.reason}")
    for who, fig in (("candidate", v.candidate), ("running", v.running)):
        print(f"  {who:<9} recall {fig['recall_precursor']:.2f} "
              f"({fig['caught_with_precursor']}/{fig['failures_with_precursor']}), "
              f"{fig['false_alarms_per_1000_gpu_days']:.2f} false alarms / 1,000 GPU-days, "
              f"threshold {fig['threshold']:.2f}, median lead {fig['median_lead_min']:.0f} min")
    print("\n".join(_drift_lines(res.drift, 10)))
    print(f"registry {registry.root}: running version {registry.current()} (a running "
          "collector switches to it at its next scoring)")
    return 0


def _drift(args: argparse.Namespace) -> int:
    from forewarn.errors import InputError
    from forewarn.models.drift import psi
    from forewarn.models.features import gpu_features

    try:
        registry = _registry(args)
        model = registry.load()
        ref = model.metadata.get("reference")
        if not ref:
            print(f"version {registry.current()} carries no training distribution (the "
                  "shipped model); retrain to measure drift", file=sys.stderr)
            return 1
        samples, xids, _outcomes = _history(args, start=time.time() - args.days * 86400.0)
        if samples.empty:
            print(f"no telemetry in the last {args.days:g} days", file=sys.stderr)
            return 1
        drift = psi(ref, gpu_features(samples, xids))
    except (InputError, OSError) as exc:
        return _fail("drift", exc)
    print(f"version {registry.current()}, last {args.days:g} days:")
    print("\n".join(_drift_lines(drift, args.top)))
    return 0


def _versions(args: argparse.Namespace) -> int:
    from forewarn.errors import InputError

    try:
        registry = _registry(args)
        current, decisions = registry.current(), registry.decisions()
    except (InputError, OSError) as exc:
        return _fail("versions", exc)
    print(f"registry {registry.root}: running version {current}"
          f"{' (the shipped model)' if current == 0 else ''}; versions "
          f"{', '.join(map(str, registry.versions()))}")
    for d in decisions:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d["time"]))
        print(f"  {when}Z  v{d['version']:<4} {d['decision']:<11} (was v{d['previous']}): "
              f"{d['reason']}")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from forewarn.errors import InputError

    try:
        registry = _registry(args)
        registry.rollback(args.version, reason=args.reason)
    except (InputError, OSError) as exc:
        return _fail("rollback", exc)
    print(f"registry {registry.root}: running version {args.version} (a running collector "
          "switches to it at its next scoring)")
    return 0
