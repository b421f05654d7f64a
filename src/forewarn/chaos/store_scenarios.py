"""The telemetry rig's chaos scenarios of the collector's store: a mismatched
``collector.db`` and a full disk; no stored row may be lost."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from forewarn.chaos.lab import Lab
from forewarn.chaos.outcome import Outcome
from forewarn.chaos.scenario_tools import (
    finish_telemetry,
    more_batches,
    new_parquet,
    parquet_files,
    settle,
)
from forewarn.chaos.telemetry_rig import TelemetryRig
from forewarn.spawn.procs import readyz, wait_until

_ROW = ["agent_id", "seq", "gpu", "time"]


def _kept_rows(data: Path) -> set[tuple[Any, ...]]:
    """(agent_id, seq, gpu, time) of every sample row a stopped collector's data dir still
    holds: in any Parquet file under it (quarantine included) or staged and readable."""
    import pyarrow.parquet as pq

    from forewarn.collector.metrics import CollectorMetrics
    from forewarn.collector.storage.staging import StagingLog
    from forewarn.collector.storage.store import Store
    from forewarn.collector.storage.telemetry import TelemetryWriter

    rows: set[tuple[Any, ...]] = set()
    for p in parquet_files(data):
        with contextlib.suppress(Exception):  # a damaged file is reported elsewhere
            t = pq.read_table(p, columns=_ROW).to_pydict()
            rows.update(zip(*(t[c] for c in _ROW), strict=True))
    store = Store(data / "collector.db")
    try:
        staged = TelemetryWriter(store, data / "telemetry", CollectorMetrics(),
                                 staging=StagingLog(data / "staging")).read()
    finally:
        store.close()
    if len(staged):
        rows.update(zip(*(staged[c].tolist() for c in _ROW), strict=True))
    return rows


def _swap_db(data: Path, replacement: Path | None) -> None:
    """Replace ``collector.db`` (and its WAL) with ``replacement``, or an empty file."""
    for suffix in ("", "-wal", "-shm"):
        (data / f"collector.db{suffix}").unlink(missing_ok=True)
    target = data / "collector.db"
    if replacement is None:
        target.write_bytes(b"")
    else:
        target.write_bytes(replacement.read_bytes())


def _restart_on(rig: TelemetryRig, what: str) -> tuple[str, str]:
    """Start the collector on a swapped database: ("refused", its error) or ("started",
    "")."""
    size = rig.collector.log.stat().st_size
    try:
        rig.collector.start()
    except RuntimeError:
        with rig.collector.log.open("rb") as f:
            f.seek(size)
            return "refused", f.read().decode(errors="replace")[-1500:]
    return "started", ""


def collector_mismatched_db(lab: Lab, out: Outcome) -> None:
    import sqlite3

    rig = lab.telemetry("mismatched-db")
    c = rig.collector
    db = c.data / "collector.db"
    wait_until(lambda: rig.stored_batches() >= 5 and parquet_files(c.data / "telemetry"), 30)
    older = c.dir / "older.db"

    def backup_while_staged() -> int:
        """A consistent copy, as a backup taken now would be; taken again until it holds
        staged (not yet flushed) batches, the case where a backup is oldest."""
        with contextlib.closing(sqlite3.connect(db)) as src, \
                contextlib.closing(sqlite3.connect(older)) as dst:
            src.backup(dst)
            return int(dst.execute("SELECT count(*) FROM staged_samples").fetchone()[0])

    staged = wait_until(backup_while_staged, 20, step=0.05) or 0
    out.figures["staged_batches_in_backup"] = staged
    new_parquet(rig, time.time() + 0.1)  # files the older database will not know
    c.stop()
    rows = _kept_rows(c.data)
    files = len(parquet_files(c.data))
    results: dict[str, Any] = {}
    for variant, replacement in (("empty", None), ("older", older)):
        _swap_db(c.data, replacement)
        result, error = _restart_on(rig, variant)
        if result == "started":
            quarantined = parquet_files(c.data / "quarantine")
            counted = c.metric("forewarn_collector_quarantined_files_total") or 0.0
            c.stop()
            out.expect(bool(quarantined) and counted > 0,
                       f"{variant} collector.db: started with {len(quarantined)} Parquet "
                       f"files quarantined ({int(counted)} counted); expected a refusal or "
                       "the unaccounted files quarantined")
            results[variant] = f"started, {len(quarantined)} Parquet files quarantined"
        else:
            out.expect(str(db) in error or "collector.db" in error,
                       f"{variant} collector.db: start refused without naming {db}: "
                       f"{error[-300:]!r}")
            results[variant] = "refused: " + next(
                (ln.strip() for ln in error.splitlines() if "collector.db" in ln), error[-200:])
        kept = _kept_rows(c.data)
        lost = len(rows - kept)
        out.expect(lost == 0, f"{variant} collector.db: {lost} of {len(rows)} Parquet rows "
                   "gone from the data dir (deleted)")
        results[f"{variant}_rows_lost"] = lost
    out.detected = "; ".join(f"{k} collector.db: {v}" for k, v in results.items()
                             if not k.endswith("_lost"))
    out.detection_s = None
    out.action = "collector restarted on an empty, then an older, collector.db"
    out.lost = (f"{max(results['empty_rows_lost'], results['older_rows_lost'])} of "
                f"{len(rows)} Parquet rows ({files} files) deleted")
    out.figures.update(parquet_files=files, parquet_rows=len(rows), **results)
    rig.agent.stop()


DISK_MB = 8


def _fill(path: Path) -> int:
    """Write ``path`` until the file system is full; returns the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12):
            block = b"\0" * chunk
            try:
                while True:
                    written += f.write(block)
            except OSError:
                continue
    return written


def disk_full(lab: Lab, out: Outcome) -> None:
    """The collector's data dir and the agent's spool on one tmpfs of ``DISK_MB`` MiB,
    filled up, then freed."""
    import subprocess

    mnt = lab.dir / "disk-full-fs"
    mnt.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs",
                              str(mnt)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        out.skipped = (f"cannot mount a {DISK_MB} MiB tmpfs (needs root or CAP_SYS_ADMIN): "
                       f"{mounted.stderr.strip()[:200]}")
        return
    try:
        _disk_full(lab, out, mnt)
    finally:
        # the rig's processes are stopped by then, or die with the lab: lazily
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def watch_errors(rig: TelemetryRig, seconds: float) -> dict[str, Any]:
    """What a person watching the rig sees for ``seconds``: whether its collector stays
    up, the ``/readyz`` status codes and the components it reports not ready, and the
    collector's flush errors and the agent's spool write errors in that time."""
    c = rig.collector
    flush0 = c.metric("forewarn_collector_telemetry_flush_errors_total") or 0.0
    spool0 = rig.agent.metric("forewarn_uplink_spool_write_errors_total") or 0.0
    codes: set[int] = set()
    not_ready: set[str] = set()
    alive = True
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            code, report = readyz(c.url, timeout=2)
        except OSError:
            alive = False
        else:
            codes.add(code)
            not_ready |= {k for k, part in report["components"].items() if not part["ready"]}
        time.sleep(0.5)
    flush = (c.metric("forewarn_collector_telemetry_flush_errors_total") or 0.0) - flush0
    spool = (rig.agent.metric("forewarn_uplink_spool_write_errors_total") or 0.0) - spool0
    return {"alive": alive and rig.lab.procs.procs[c.name].poll() is None,
            "readyz": sorted(codes), "readyz_not_ready": sorted(not_ready),
            "flush_errors": int(flush), "spool_write_errors": int(spool)}


def disk_error_visible(seen: dict[str, Any]) -> bool:
    """Whether :func:`watch_errors` saw an error that speaks of the disk: a flush error
    or the storage component not ready. Not any 503: ``/readyz`` is also 503 while the
    predictor loads its model after a start (seconds on a loaded machine)."""
    return bool(seen["flush_errors"] > 0 or "storage" in seen["readyz_not_ready"])


def _disk_full(lab: Lab, out: Outcome, mnt: Path) -> None:
    rig = lab.telemetry("disk-full", disk=mnt)
    rig.storing()
    full_s = 8.0
    filler = mnt / "filler"
    filled = _fill(filler)
    seen = watch_errors(rig, full_s)
    filler.unlink()
    t_free = time.time()
    out.expect(seen.pop("alive"), "the collector died or stopped answering while the disk "
               "was full")
    out.expect(disk_error_visible(seen), f"no visible error while the disk was full: {seen}")
    written = new_parquet(rig, t_free)
    out.expect(written, "no Parquet file written after the space was freed")
    drained = settle(rig, out, "after the space was freed")
    out.detected = (f"collector: readyz {seen['readyz']} (not ready: "
                    f"{', '.join(seen['readyz_not_ready'])}), {seen['flush_errors']} flush "
                    f"errors; agent: {seen['spool_write_errors']} spool write errors")
    out.detection_s = drained
    out.action = (f"a {DISK_MB} MiB tmpfs (data dir and spool) filled for {full_s:g} s, then "
                  "freed: Parquet written again, spool replayed")
    out.figures.update(disk_mb=DISK_MB, filled_bytes=filled, full_s=full_s,
                       written_after_free=written, **seen)
    more_batches(rig)
    finish_telemetry(lab, rig, out, excused=[])
