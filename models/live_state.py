"""What a :class:`~forewarn.models.live.LiveScorer` learned, as bytes that survive a
collector restart or a scale-out takeover: every GPU's own baseline, its alarm memory
(episodes, raised bars, alarm budget) and the shadow counts.

:func:`snapshot` writes an ``.npz`` archive (numpy's own format, read back with
``allow_pickle=False``: never pickle) of

* every numpy array the scorer holds, found by walking its attributes rather than by a
  list kept here, so an array added to the scorer later is saved with the others; arrays
  with one element per GPU slot (the last axis) are cut to the GPUs seen. One exception,
  :data:`SHORTENED`: the hour ring of per-minute rows is kept as its newest row only (the
  whole ring is 61 rows, most of the snapshot's size) and :func:`restore` fills the hour
  before the snapshot from it at each GPU's own long-run rates (:func:`_backfill`);
* a JSON document (``meta``, stored as bytes in the archive) with the grid layout the
  arrays follow, the GPU keys in slot order, the last minute on the grid, the job map,
  the alarm memories and the shadow counts (:data:`SAVED`).

:func:`restore` validates everything before it changes the scorer: the format, the grid
layout (:func:`layout`: another feature grid's columns, lags or baseline blocks are
refused), the set of arrays (one the scorer has and the snapshot lacks, or the reverse,
is refused: never a silently missing state), each array's dtype and shape, the GPU keys,
and the snapshot's age (its time or its last minute on the grid older than a week, what
the scorer's own clock accepts as one jump, or more than an hour ahead of this clock).
Each archive member's dtype and shape are read from its header and checked before it is
decompressed: a corrupt or hostile blob cannot inflate into the collector's memory. A
snapshot that does not fit raises :class:`SnapshotError` naming the reason and leaves the
scorer as it was; one that is readable but of another format, feature grid or set of state
arrays (another forewarn version wrote it) raises its subclass :class:`ForeignSnapshot`.

Every attribute of the scorer is either an array (saved), in :data:`SAVED`, or in
:data:`NOT_SAVED` with the reason; ``tests/models/test_live_state.py`` fails on one that is
in none, so a new kind of state is a decision, not an accident.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from forewarn.errors import InputError
from forewarn.models.alarms import AlarmMemory, Episode
from forewarn.models.features import BASELINE_BLOCK, CUM_COLUMNS, GRID_S, LAGS, LAST_COLUMNS

if TYPE_CHECKING:
    from forewarn.models.live import LiveScorer

__all__ = ["MAX_AGE_S", "MAX_AHEAD_S", "MAX_GPUS", "MAX_META_BYTES", "NOT_SAVED", "SAVED",
           "SHORTENED", "Captured", "ForeignSnapshot", "SnapshotError", "capture", "encode",
           "held_until", "layout", "restore", "snapshot"]

FORMAT: Final = 1
"""Version of the archive's layout (what :func:`restore` reads)."""
MAX_AGE_S: Final = 7 * 86400.0
"""Older snapshots are refused: the scorer's clock takes no longer jump in one step."""
MAX_AHEAD_S: Final = 3600.0
"""Snapshots whose time or last minute is further ahead of this replica's clock are
refused: the scorer would take every sample as late until that minute came (ingest
refuses samples 300 s ahead; the rest is room for the replicas' clocks to differ)."""
SHORTENED: Final = "_ring"
"""The hour ring: saved as its newest row (``ring_last``), filled back at restore."""
SAVED: Final = frozenset({"_minute", "_nodes", "_gpus", "_jobs", "memory", "peers", "_true",
                          "_false", "_failures", "_caught", "_leads", "_last_failure"})
"""Attributes other than arrays that :func:`snapshot` saves."""
NOT_SAVED: Final = {
    "model": "the collector's own, loaded at start",
    "stale_s": "configuration", "job_stale_s": "configuration",
    "_index": "rebuilt from the GPU keys", "_node_ids": "rebuilt from the GPU keys",
    "_node_index": "rebuilt from the GPU keys",
    "_jobs_changed": "a change counter: bumped at restore",
    "_scores": "a cache of one minute's scoring", "_job_scores": "a cache",
    "skipped": "this process's count", "late": "this process's count",
    "repeated": "this process's count",
    "_wall": "this process's last scoring",
    "_held": "samples ahead of the wall clock (after the saved minute: read again)",
    "_arrivals": "a counter ordering the held samples",
}
"""Attributes :func:`snapshot` leaves out, and why."""


class SnapshotError(InputError, ValueError):
    """A snapshot that does not fit this scorer; the message names the reason."""


class ForeignSnapshot(SnapshotError):
    """A readable snapshot of another format, feature grid, or set or dtype of state
    arrays: another forewarn version wrote it (a newer one, during a rolling upgrade), not
    a corrupt write, so the replicas of that version can still restore it."""


def layout() -> dict[str, Any]:
    """What the state arrays mean: the grid's columns, step, lags and baseline block."""
    return {"cum": list(CUM_COLUMNS), "last": list(LAST_COLUMNS), "grid_s": GRID_S,
            "lags": list(LAGS), "block": BASELINE_BLOCK}


def held_until(scorer: LiveScorer) -> float | None:
    """The end of the last minute ``scorer`` holds on its grid (None: nothing yet)."""
    m = scorer._minute
    return None if m is None else (m + 1) * GRID_S


def _capacity(scorer: LiveScorer) -> int:
    return int(scorer._last_seen.shape[-1])


def _arrays(scorer: LiveScorer) -> dict[str, np.ndarray]:
    """Every numpy array attribute of the scorer, by name."""
    return {k: v for k, v in vars(scorer).items() if isinstance(v, np.ndarray)}


def _memory(m: AlarmMemory) -> dict[str, Any]:
    return {"episodes": {str(k): [[e.start, e.end] for e in eps] for k, eps in m.episodes.items()
                         if eps},
            "false_at": {str(k): v for k, v in m._false_at.items() if v},
            "recent": {str(k): v for k, v in m._recent.items() if v},
            "suppressed": m.suppressed, "opened": m.opened}


class Captured:
    """The scorer's state copied at one moment (:func:`capture`): cheap to take on the
    scorer's thread; :func:`encode` turns it into bytes on any thread."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.arrays = arrays
        self.meta = meta

    @property
    def gpus(self) -> int:
        """GPUs in it."""
        return len(self.meta["nodes"])

    @property
    def held(self) -> float:
        """The end of the last minute on the scorer's grid (0: none yet)."""
        m = self.meta["minute"]
        return 0.0 if m is None else (m + 1) * GRID_S


def capture(scorer: LiveScorer, now: float) -> Captured:
    """A copy of ``scorer``'s state at ``now`` (see the module docstring)."""
    n, cap = scorer.gpus, _capacity(scorer)
    arrays = {}
    for name, a in _arrays(scorer).items():
        if name == SHORTENED:
            m = scorer._minute
            a = a[(m if m is not None else 0) % a.shape[0]]
            name = "ring_last"
        arrays[name] = a[..., :n].copy() if a.shape[-1:] == (cap,) else a.copy()
    meta = {
        "format": FORMAT, "time": now, "layout": layout(), "nodes": list(scorer._nodes),
        "gpus": [int(g) for g in scorer._gpus], "minute": scorer._minute,
        "jobs": [[int(i), job, t] for i, (job, t) in scorer._jobs.items()],
        "memory": _memory(scorer.memory), "peers": _memory(scorer.peers.memory),
        "shadow": {"true": scorer._true, "false": scorer._false,
                   "failures": scorer._failures, "caught": scorer._caught,
                   "leads": list(scorer._leads),
                   "last_failure": [[int(i), t] for i, t in scorer._last_failure.items()]},
    }
    return Captured(arrays, meta)


def encode(c: Captured) -> bytes:
    """The archive's bytes (compressed: most of the state is zeros)."""
    buf = io.BytesIO()
    arrays = {"meta": np.frombuffer(json.dumps(c.meta).encode(), np.uint8), **c.arrays}
    np.savez_compressed(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def snapshot(scorer: LiveScorer, now: float) -> bytes:
    """:func:`capture` then :func:`encode`."""
    return encode(capture(scorer, now))


# -- restore ------------------------------------------------------------------------------

_UNREADABLE: Final = (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError,
                      EOFError)
MAX_META_BYTES: Final = 64 << 20
"""Largest meta document read (a 20,000-GPU fleet's is a few MiB)."""
MAX_GPUS: Final = 1_000_000
"""Most GPUs a snapshot may hold (10x docs/scale.md's capacity model): bounds what a
hostile archive whose members agree with each other can inflate to (1,360 bytes a GPU)."""
_Header = tuple[np.dtype[Any], tuple[int, ...]]


def _unreadable(exc: Exception) -> SnapshotError:
    return SnapshotError(f"not a readable snapshot: {type(exc).__name__}: {exc}")


def _headers(z: Any) -> dict[str, _Header]:
    """Each member's dtype and shape, read from its .npy header alone: what it would
    inflate to is checked before any member is decompressed (a bomb is refused unread)."""
    out = {}
    try:
        for name in z.files:
            with z.zip.open(f"{name}.npy") as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise ValueError(f"member {name}: .npy version {version}")
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, _fortran, dtype = read(f)
            out[name] = (dtype, shape)
    except _UNREADABLE as exc:
        raise _unreadable(exc) from None
    return out


def _load(z: Any, name: str) -> np.ndarray:
    try:
        return np.asarray(z[name])
    except _UNREADABLE as exc:
        raise _unreadable(exc) from None


def _read_meta(z: Any, headers: Mapping[str, _Header]) -> dict[str, Any]:
    dtype, shape = headers.get("meta", (None, ()))
    if dtype != np.uint8 or len(shape) != 1 or shape[0] > MAX_META_BYTES:
        raise SnapshotError(f"meta: {dtype}{list(shape)}, expected at most "
                            f"{MAX_META_BYTES} bytes")
    try:
        meta = json.loads(_load(z, "meta").tobytes().decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _unreadable(exc) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        error = ForeignSnapshot if isinstance(got, int) else SnapshotError
        raise error(f"format {got!r}, this forewarn reads {FORMAT}")
    return meta


def _check_layout(meta: Mapping[str, Any]) -> None:
    want, got = layout(), meta.get("layout")
    if got == want:
        return
    if not isinstance(got, dict):
        raise SnapshotError("no grid layout")
    cols = set(got.get("cum", [])) | set(got.get("last", []))
    mine = set(want["cum"]) | set(want["last"])
    diff = [f"{k} {got.get(k)} (here {want[k]})" for k in ("grid_s", "lags", "block")
            if got.get(k) != want[k]]
    if cols != mine:
        diff.append(f"columns only in the snapshot {sorted(cols - mine)}, only here "
                    f"{sorted(mine - cols)}")
    raise ForeignSnapshot("another feature grid: " + ("; ".join(diff) or "columns reordered"))


def _keys(meta: Mapping[str, Any]) -> tuple[list[str], list[int]]:
    nodes, gpus = meta.get("nodes"), meta.get("gpus")
    if not (isinstance(nodes, list) and isinstance(gpus, list) and len(nodes) == len(gpus)
            and all(isinstance(x, str) for x in nodes)
            and all(isinstance(g, int) and g >= 0 for g in gpus)):
        raise SnapshotError("GPU keys: not a list of (node, GPU index) pairs")
    if len(nodes) > MAX_GPUS:
        raise SnapshotError(f"GPU keys: {len(nodes)} GPUs, at most {MAX_GPUS}")
    if len(set(zip(nodes, gpus, strict=True))) != len(nodes):
        raise SnapshotError("GPU keys: a GPU appears twice")
    return nodes, gpus


def _check_arrays(scorer: LiveScorer, headers: Mapping[str, _Header], n: int) -> None:
    """Every state array is in ``headers`` (the archive's members but ``meta``) with the
    dtype and shape this scorer's has for ``n`` GPUs; nothing else is."""
    mine = {("ring_last" if k == SHORTENED else k): v for k, v in _arrays(scorer).items()}
    if set(mine) != set(headers):
        raise ForeignSnapshot(f"state arrays differ: missing {sorted(set(mine) - set(headers))}, "
                            f"unknown {sorted(set(headers) - set(mine))}")
    cap = _capacity(scorer)
    for name, (dtype, got) in headers.items():
        ref = mine[name]
        if name == "ring_last":
            ref = ref[0]
        shape = (*ref.shape[:-1], n) if ref.shape[-1:] == (cap,) else ref.shape
        if dtype != ref.dtype or got != shape:
            # another dtype is another version's choice; another shape, a corrupt write
            error = ForeignSnapshot if dtype != ref.dtype else SnapshotError
            raise error(f"array {name}: {dtype}{list(got)}, expected "
                        f"{ref.dtype}{list(shape)}")


_Memory = tuple[dict[int, list[Episode]], dict[int, list[float]], dict[int, list[float]],
                int, int]


def _parse_memory(d: Any, n: int) -> _Memory:
    """An alarm memory as :func:`_memory` wrote it; GPU slots as keys, each below ``n``."""
    try:
        def slots(x: Mapping[str, Any]) -> dict[int, Any]:
            out = {int(k): v for k, v in x.items()}
            if any(not 0 <= k < n for k in out):
                raise ValueError("a GPU slot out of range")
            return out

        return ({k: [Episode(float(a), float(b)) for a, b in v]
                 for k, v in slots(d["episodes"]).items()},
                {k: [float(t) for t in v] for k, v in slots(d["false_at"]).items()},
                {k: [float(t) for t in v] for k, v in slots(d["recent"]).items()},
                int(d["suppressed"]), int(d["opened"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"alarm memory: {exc}") from None


def _set_memory(m: AlarmMemory, parsed: _Memory) -> None:
    m.episodes, m._false_at, m._recent, m.suppressed, m.opened = parsed  # type: ignore[assignment]


def _backfill(ring: np.ndarray, last: np.ndarray, first: np.ndarray,
              first_minute: np.ndarray, minute: int) -> None:
    """Fill the hour ring before ``minute`` (whose row is ``last``) at each GPU's own rate
    since it was met (``first`` at ``first_minute``): windows that reach back across the
    restart read the GPU's usual behaviour, neither a silence (every GPU "going quiet")
    nor a burst."""
    span = np.maximum(minute - first_minute, 1).astype(np.float64)
    rate = np.maximum(last - first, 0.0) / span
    rows = ring.shape[0]
    for k in range(rows):
        ring[(minute - k) % rows] = np.maximum(last - k * rate, first)


def restore(scorer: LiveScorer, blob: bytes, now: float) -> int:
    """Put the state of ``blob`` (:func:`snapshot`) into ``scorer``; the GPUs restored.
    Raises :class:`SnapshotError` (scorer untouched) when it does not fit."""
    if not blob.startswith(b"PK\x03\x04"):  # np.load would read a bare .npy (or a pickle)
        raise SnapshotError("not a readable snapshot: not an .npz archive")
    try:
        z = np.load(io.BytesIO(blob), allow_pickle=False)
    except _UNREADABLE as exc:
        raise _unreadable(exc) from None
    with z:
        return _restore(scorer, z, now)


def _restore(scorer: LiveScorer, z: Any, now: float) -> int:
    headers = _headers(z)
    meta = _read_meta(z, headers)
    del headers["meta"]
    _check_layout(meta)
    t = meta.get("time")
    if not isinstance(t, (int, float)) or not math.isfinite(t):
        raise SnapshotError("no time")
    if now - t > MAX_AGE_S:
        raise SnapshotError(f"{(now - t) / 86400:.1f} days old (at most "
                            f"{MAX_AGE_S / 86400:.0f})")
    minute = meta.get("minute")
    if minute is not None and not isinstance(minute, int):
        raise SnapshotError("minute: not an integer")
    if minute is not None and now - (minute + 1) * GRID_S > MAX_AGE_S:
        # the scorer would refuse every sample as a clock jump (and walk every minute
        # since at its first scoring): as good as a snapshot that old
        raise SnapshotError(f"minute {minute}: {(now - (minute + 1) * GRID_S) / 86400:.1f} "
                            f"days old (at most {MAX_AGE_S / 86400:.0f})")
    ahead = max(t, 0.0 if minute is None else (minute + 1) * GRID_S) - now
    if ahead > MAX_AHEAD_S:
        raise SnapshotError(f"{ahead:.0f} s ahead of this clock (at most {MAX_AHEAD_S:.0f})")
    nodes, gpus = _keys(meta)
    n = len(nodes)
    _check_arrays(scorer, headers, n)
    arrays = {name: _load(z, name) for name in headers}  # each of the size checked
    memory = _parse_memory(meta.get("memory"), n)
    peers = _parse_memory(meta.get("peers"), n)
    try:
        shadow = meta["shadow"]
        counts = (int(shadow["true"]), int(shadow["false"]), int(shadow["failures"]),
                  int(shadow["caught"]), [float(x) for x in shadow["leads"]],
                  {int(i): float(t) for i, t in shadow["last_failure"]},
                  {int(i): (str(job), float(t)) for i, job, t in meta["jobs"]})
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"shadow counts or job map: {exc}") from None
    # Validated: from here on nothing refuses.
    _install(scorer, arrays, n, minute)
    _set_memory(scorer.memory, memory)
    _set_memory(scorer.peers.memory, peers)
    (scorer._true, scorer._false, scorer._failures, scorer._caught, scorer._leads,
     scorer._last_failure, scorer._jobs) = counts
    scorer._nodes, scorer._gpus = list(nodes), list(gpus)
    scorer._index = {(node, g): i for i, (node, g) in enumerate(zip(nodes, gpus, strict=True))}
    scorer._node_index = {}
    scorer._node_ids = [scorer._node_index.setdefault(node, len(scorer._node_index))
                        for node in nodes]
    scorer._minute = minute
    scorer._scores = scorer._job_scores = None
    scorer._jobs_changed += 1
    return n


def _install(scorer: LiveScorer, arrays: Mapping[str, np.ndarray], n: int,
             minute: int | None) -> None:
    """The arrays into the scorer, each at a capacity of at least ``n`` GPU slots; the
    slots past ``n`` as a fresh scorer has them."""
    cap = _capacity(scorer)
    while cap < n:
        cap *= 2
    old = _capacity(scorer)
    blank = vars(type(scorer)(scorer.model, capacity=1))  # how a fresh slot starts
    for name, ref in _arrays(scorer).items():
        saved = arrays["ring_last" if name == SHORTENED else name]
        if ref.shape[-1:] != (old,):
            setattr(scorer, name, saved.copy())
            continue
        out = np.empty((*ref.shape[:-1], cap), ref.dtype)
        out[...] = blank[name][..., :1]
        out[..., :n] = saved  # the ring: its newest row in every row, backfilled below
        setattr(scorer, name, out)
    if minute is not None and n:
        _backfill(scorer._ring[..., :n], arrays["ring_last"], scorer._first[:, :n],
                  scorer._first_minute[:n], minute)
