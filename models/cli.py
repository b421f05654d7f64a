"""``forewarn models``: simulate, train, evaluate, backtest, rank.

``simulate-fleet``  write labelled telemetry (samples.parquet, xids.parquet, labels.csv)
``train``           data in (replay/Parquet directories with labels), model out (.skops)
``eval``            report: precision, recall, lead times, false alarms, baseline, PNGs
``backtest``        run a model over replay files; list alarms (and judge them if labelled)
``rank``            rank GPUs and nodes by risk from an event-history CSV ("lemons")
``rank-backtest``   judge the ranking against baselines at rolling cuts of an event history
``retrain``, ``drift``, ``versions``, ``rollback``: learn from the collector's own store
(added by forewarn.collector.retrain, which may read the store)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_dir", "register"]


def register(sub: Any) -> Any:
    """Add ``models`` to the ``forewarn`` command; returns its actions' subparsers (the
    collector adds ``retrain``, ``drift``, ``versions``, ``rollback`` to them:
    :mod:`forewarn.collector.retrain`)."""
    from forewarn.models.train import DETECTORS, SHIPPED_DETECTOR

    p: argparse.ArgumentParser = sub.add_parser(
        "models", help="failure-prediction models: simulate, train, eval, backtest, ranking",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ms = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    s = ms.add_parser("simulate-fleet", help="write labelled simulated fleet telemetry")
    s.add_argument("--params", help="fleet parameter TOML (default: the shipped one)")
    s.add_argument("--out", required=True, help="output directory")
    for flag, typ in (("--nodes", int), ("--gpus-per-node", int), ("--days", float),
                      ("--interval", float), ("--seed", int), ("--precursor-scale", float),
                      ("--noise-scale", float), ("--rate", float)):
        s.add_argument(flag, type=typ)
    s.set_defaults(func=_simulate)

    t = ms.add_parser("train", help="train a failure predictor (data in, model out)")
    t.add_argument("--data", action="append", default=[],
                   help="directory with samples.parquet/.csv or a telemetry/ Parquet store "
                        "(the collector's), optional xids and labels.csv (without one, "
                        "failures are found in the telemetry); repeatable")
    t.add_argument("--simulate", action="store_true",
                   help="train on the built-in simulated training suite instead")
    t.add_argument("--scale", type=float, default=1.0, help="size of the simulated suite")
    t.add_argument("--out", required=True, help="model file to write (.skops)")
    t.add_argument("--detector", choices=DETECTORS, default=SHIPPED_DETECTOR,
                   help="rules_forest (shipped): repeated hardware XIDs, a counter beyond "
                   "the GPU's own rate most of the hour, or an isolation forest far out; "
                   "model: the gradient-boosted failure predictor (docs/models.md)")
    t.add_argument("--horizon-min", type=float, default=60.0, help="prediction horizon H")
    t.add_argument("--threshold", type=float, help="operating threshold (default: tuned)")
    t.add_argument("--target-false-alarms", type=float, default=0.5,
                   help="false alarms per 1,000 GPU-days the tuned threshold aims under")
    t.set_defaults(func=_train)

    e = ms.add_parser("eval", help="evaluation report with figures and PNGs")
    e.add_argument("--model", help="model file (default: the shipped model)")
    e.add_argument("--data", action="append", default=[], help="labelled data directory")
    e.add_argument("--heldout", action="store_true",
                   help="evaluate on the built-in held-out simulated suite")
    e.add_argument("--scale", type=float, default=1.0, help="size of the simulated suite")
    e.add_argument("--report", required=True, help="output directory for the report")
    e.set_defaults(func=_eval)

    b = ms.add_parser("backtest", help="run a model over replay files")
    b.add_argument("--model", help="model file (default: the shipped model)")
    b.add_argument("--samples", required=True, help="replay samples file or directory")
    b.add_argument("--xids", help="XID events file")
    b.add_argument("--labels", help="failure labels CSV (judges the alarms)")
    b.add_argument("--threshold", type=float, help="override the model's threshold")
    b.add_argument("--out", help="write alarm episodes to this CSV")
    b.set_defaults(func=_backtest)

    r = ms.add_parser("rank", help="rank GPUs/nodes by failure risk from an events CSV")
    r.add_argument("--events", required=True, help="events CSV (docs/models.md)")
    r.add_argument("--days", type=float, default=90.0, help="risk horizon N in days")
    r.add_argument("--as-of", type=float,
                   help="rank as of this time (epoch seconds); later events are not read")
    r.add_argument("--top", type=int, default=20)
    r.add_argument("--out", help="write the full ranking to this CSV")
    r.set_defaults(func=_rank)

    rb = ms.add_parser("rank-backtest", help="judge the lemon ranking against baselines")
    rb.add_argument("--events", help="events CSV (docs/models.md)")
    rb.add_argument("--simulate", action="store_true",
                    help="use a generated fleet history (models/lifesim.py) instead")
    rb.add_argument("--gpus", type=int, default=20_000, help="size of the generated fleet")
    rb.add_argument("--seed", type=int, default=0, help="seed of the generated fleet")
    rb.add_argument("--days", type=float, default=90.0, help="risk horizon in days")
    rb.add_argument("--every", type=float, default=182.5, help="days between cuts")
    rb.add_argument("--warmup", type=float, default=365.0, help="days of history before "
                    "the first cut")
    rb.add_argument("--top-share", type=float, default=0.01,
                    help="k of precision@k as a share of the GPUs in service")
    rb.add_argument("--out", help="write the per-cut, per-method results to this CSV")
    rb.add_argument("--markdown", help="replace the backtest table in this Markdown file "
                    "(between its rank-backtest markers)")
    rb.set_defaults(func=_rank_backtest)

    ef = ms.add_parser("eval-families", help="leave-one-family-out evaluation: model vs "
                       "rules vs isolation forest, per behaviour family")
    ef.add_argument("--scale", type=float, default=1.0,
                    help="size of the simulated pool (1.0: 3 fleets of 10 nodes x 4 days)")
    ef.add_argument("--family", action="append", default=[],
                    help="only this family (repeatable; default: every family)")
    ef.add_argument("--threads", type=int, default=1,
                    help="OpenMP/BLAS threads (default 1: a shared machine)")
    ef.add_argument("--seed", type=_seed_list, default=[0], metavar="N[,N...]",
                    help="the pool's seed (default 0); several, comma-separated, pool the "
                    "folds of as many pools (a ranking that is not one pool's luck)")
    ef.add_argument("--out", help="write each fold's results to this CSV as it finishes; "
                    "a rerun with the same file skips the folds it holds")
    ef.add_argument("--markdown", help="replace the table in this Markdown file (between "
                    "its eval-families markers)")
    ef.set_defaults(func=_eval_families)
    return ms


def load_dir(d: str) -> tuple[Any, Any, Any]:
    """(samples, xids or None, labels or None) of a data directory in the replay format."""
    from forewarn.models.schema import DataError, read_table, validate_labels

    p = Path(d)
    samples = xids = labels = None
    for name in ("samples.parquet", "samples.csv", "telemetry"):
        if (p / name).exists():
            samples = read_table(p / name)
            break
    if samples is None:
        raise DataError(f"{p}: no samples.parquet, samples.csv or telemetry/ directory")
    for name in ("xids.parquet", "xids.csv"):
        if (p / name).exists():
            xids = read_table(p / name)
    if (p / "labels.csv").exists():
        labels = validate_labels(read_table(p / "labels.csv"), f"{p / 'labels.csv'}")
    return samples, xids, labels


def _labels_or_derived(d: str, samples: Any, xids: Any, labels: Any) -> Any:
    """The directory's labels.csv, or failures found in its own telemetry."""
    if labels is not None:
        return labels
    from forewarn.models.labels import labels_from_telemetry

    derived = labels_from_telemetry(samples, xids)
    print(f"{d}: no labels.csv; {len(derived)} failure(s) found in the telemetry "
          "(fatal XIDs, lost GPUs, uncorrectable errors)", file=sys.stderr)
    return derived


def _features_from_dirs(dirs: list[str]) -> list[tuple[str, Any, Any]]:
    from forewarn.models.features import gpu_features

    out = []
    for d in dirs:
        samples, xids, labels = load_dir(d)
        labels = _labels_or_derived(d, samples, xids, labels)
        out.append((d, gpu_features(samples, xids), labels))
    return out


def _simulate(args: argparse.Namespace) -> int:
    from forewarn.models.fleetsim import load_params, simulate_fleet, write_fleet

    p = load_params(args.params)
    changes = {k: v for k, v in (
        ("nodes", args.nodes), ("gpus_per_node", args.gpus_per_node), ("days", args.days),
        ("sample_interval_s", args.interval), ("seed", args.seed),
        ("precursor_scale", args.precursor_scale), ("noise_scale", args.noise_scale),
        ("rate_per_1000_gpu_days", args.rate)) if v is not None}
    data = simulate_fleet(p.replace(**changes))
    paths = write_fleet(data, args.out)
    print(f"{len(data.samples)} samples, {len(data.xids)} XIDs, {len(data.labels)} failures "
          f"({int(data.labels['had_precursor'].sum())} with a precursor) -> "
          f"{', '.join(str(v) for v in paths.values())}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from forewarn.models.fleetsim import load_params
    from forewarn.models.persist import save_model
    from forewarn.models.schema import DataError
    from forewarn.models.suites import simulate_features, train_suite, tune_params
    from forewarn.models.train import train_detector

    try:
        tune = None
        if args.simulate:
            sets = [simulate_features(p) for p in train_suite(scale=args.scale)]
            tune = simulate_features(tune_params(scale=args.scale))
        elif args.data:
            sets = [(f, lab) for _, f, lab in _features_from_dirs(args.data)]
        else:
            print("forewarn models train: give --data DIR or --simulate", file=sys.stderr)
            return 2
        # Simulated fleets fail far more often than real ones: rules_forest's alarm score
        # is calibrated to P(failure) at a real fleet's rate; a fleet's own data at its own.
        real = load_params().real_per_1000_gpu_days if args.simulate else None
        model = train_detector(args.detector, sets, tune=tune,
                               horizon_s=args.horizon_min * 60, threshold=args.threshold,
                               target_false_alarms=args.target_false_alarms,
                               base_rate_per_1000_gpu_days=real)
    except (DataError, ValueError) as exc:
        print(f"forewarn models train: {exc}", file=sys.stderr)
        return 2
    save_model(model, args.out)
    print(f"model -> {args.out}: threshold {model.threshold:.2f}, horizon "
          f"{model.horizon_s / 60:.0f} min, {json.dumps(model.metadata)}")
    return 0


def _model(path: str | None) -> Any:
    from forewarn.models.persist import load_default_model, load_model

    return load_model(path) if path else load_default_model()


def _eval(args: argparse.Namespace) -> int:
    from forewarn.models.persist import ModelError
    from forewarn.models.report import evaluate_model, write_report
    from forewarn.models.schema import DataError
    from forewarn.models.suites import heldout_suite, iter_features

    try:
        model = _model(args.model)
        sets = iter_features(heldout_suite(scale=args.scale)) if args.heldout \
            else iter(_features_from_dirs(args.data))
        if not args.heldout and not args.data:
            print("forewarn models eval: give --data DIR or --heldout", file=sys.stderr)
            return 2
        report = evaluate_model(model, sets)
    except (DataError, ModelError) as exc:
        print(f"forewarn models eval: {exc}", file=sys.stderr)
        return 2
    paths = write_report(report, args.report)
    print(Path(paths["md"]).read_text())
    print("goals: " + ", ".join(f"{k} {'met' if v else 'NOT met'}"
                                for k, v in report["goals"].items()))
    print(f"report -> {args.report}")
    return 0


def _backtest(args: argparse.Namespace) -> int:
    from forewarn.models.evaluate import alarm_episodes, evaluate_scores
    from forewarn.models.features import gpu_features
    from forewarn.models.persist import ModelError
    from forewarn.models.schema import DataError, read_table, validate_labels

    try:
        model = _model(args.model)
        samples = read_table(args.samples)
        xids = read_table(args.xids) if args.xids else None
        feats = gpu_features(samples, xids)
        labels = validate_labels(read_table(args.labels), args.labels) if args.labels else None
    except (DataError, ModelError) as exc:
        print(f"forewarn models backtest: {exc}", file=sys.stderr)
        return 2
    thr = model.threshold if args.threshold is None else args.threshold
    scored = model.score(feats)
    ep = alarm_episodes(scored, thr)
    print(f"{len(feats)} GPU-minutes scored, {len(ep)} alarm episodes at threshold {thr:.2f}")
    print(ep.head(50).to_string(index=False))
    if args.out:
        ep.to_csv(args.out, index=False)
    if labels is not None:
        from forewarn.models.predictor import label_rows

        _y, keep = label_rows(feats, labels, model.horizon_s)
        r = evaluate_scores(scored.loc[keep], labels, thr, horizon_s=model.horizon_s)
        print(json.dumps({k: v for k, v in r.as_dict().items() if "lead_times" not in k},
                         indent=1))
    return 0


def _rank(args: argparse.Namespace) -> int:
    from forewarn.models.lemon import LemonRanker, read_events
    from forewarn.models.schema import DataError

    try:
        ev = read_events(args.events)
    except (DataError, OSError) as exc:
        print(f"forewarn models rank: {exc}", file=sys.stderr)
        return 2
    ranker = LemonRanker(horizon_days=args.days).fit(ev, as_of=args.as_of)
    ranked = ranker.rank()
    print(f"method: {ranked['method'].iloc[0]}; risk of a hard failure in {args.days:g} days")
    print(ranked.head(args.top)[["gpu_id", "location", "cohort", "risk", "hard_all",
                                 "age_days"]].to_string(index=False))
    print("\nnodes:")
    print(ranker.node_risk(ranked).head(args.top).to_string(index=False))
    if args.out:
        ranked.to_csv(args.out, index=False)
    return 0


def _replace_marked(path: str, name: str, text: str) -> bool:
    """Replace the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = Path(path).read_text()
    if begin not in doc or end not in doc:
        print(f"forewarn models {name}: {path} has no {begin} ... {end}", file=sys.stderr)
        return False
    head, rest = doc.split(begin, 1)
    Path(path).write_text(f"{head}{begin}\n{text}{end}{rest.split(end, 1)[1]}")
    return True


def _eval_families(args: argparse.Namespace) -> int:
    import time

    import pandas as pd
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    from forewarn.models.lofo import (
        FoldFile,
        best_detector,
        family_pool,
        leave_family_out,
        markdown,
    )

    started = time.monotonic()
    folds = FoldFile(args.out, args.scale) if args.out else None
    try:
        done = folds.read() if folds else None
    except ValueError as exc:
        print(f"forewarn models eval-families: {exc}", file=sys.stderr)
        return 2
    def progress(seed: int) -> Callable[[str], None]:
        return lambda m: print(f"seed {seed}: {m}", file=sys.stderr, flush=True)

    parts, gpu_days, failures = [], 0.0, 0
    with threadpool_limits(args.threads):
        for seed in args.seed:
            pool = family_pool(scale=args.scale, seed=seed)
            skip = set() if done is None else set(done.loc[done["seed"] == seed, "family"])
            parts.append(leave_family_out(
                pool, families=args.family or None, seed=seed, progress=progress(seed),
                skip=skip, on_fold=folds.append if folds else None))
            gpu_days += len(pool.features) * 60 / 86400
            failures += len(pool.labels)
    if done is not None and len(done):  # folds of these seeds done before
        parts.insert(0, done[done["seed"].isin(args.seed)])
    res = pd.concat(parts, ignore_index=True)
    rate = pool.real_precursor_per_1000_gpu_days
    seeds = ",".join(str(k) for k in args.seed)
    table = (f"Pool: 3 simulated fleets per seed, {gpu_days:,.0f} GPU-days, {failures} failures "
             f"(`forewarn models eval-families --scale {args.scale:g} --seed {seeds}`, "
             f"{time.monotonic() - started:,.0f} s). Precision at the real rate assumes "
             f"{rate:.2f} failures with a precursor per 1,000 GPU-days. Best on "
             f"leave-family-out (recall x precision at the real rate): "
             f"**{best_detector(res, rate)}**.\n\n" + markdown(res, rate))
    print(table)
    if args.markdown and not _replace_marked(args.markdown, "eval-families", table):
        return 2
    return 0


def _seed_list(text: str) -> list[int]:
    """``--seed``: one seed or several, comma-separated (argparse names the option when one
    is not a number)."""
    return [int(x) for x in text.split(",")]


def _rank_backtest(args: argparse.Namespace) -> int:
    from forewarn.models.lemon import read_events
    from forewarn.models.lemon_backtest import backtest, markdown
    from forewarn.models.schema import DataError

    try:
        if args.simulate:
            from forewarn.models.lifesim import LifeParams, simulate_life

            source = f"generated fleet (models/lifesim.py, --gpus {args.gpus} --seed {args.seed})"
            ev = read_events(simulate_life(LifeParams(gpus=args.gpus, seed=args.seed)))
        elif args.events:
            source, ev = args.events, read_events(args.events)
        else:
            print("forewarn models rank-backtest: give --events CSV or --simulate",
                  file=sys.stderr)
            return 2
    except (DataError, OSError) as exc:
        print(f"forewarn models rank-backtest: {exc}", file=sys.stderr)
        return 2
    res = backtest(ev, horizon_days=args.days, every_days=args.every,
                   warmup_days=args.warmup, top_share=args.top_share)
    table = (f"Events: {source}. Horizon {args.days:g} days, a cut every {args.every:g} "
             f"days after {args.warmup:g} days of history; k = {args.top_share:.0%} of the "
             f"GPUs in service.\n\n" + markdown(res))
    print(table)
    if args.out:
        res.to_csv(args.out, index=False)
    if args.markdown and not _replace_marked(args.markdown, "rank-backtest", table):
        return 2
    return 0
