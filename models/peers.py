"""Peer comparison inside a job (after Minder, NSDI 2025; docs/reference.md).

The ranks/GPUs of one data-parallel job do the same work, so healthy peers look alike and
the one that drifts from its peers is the suspect. Per time bucket, each metric is
normalised across the job's members (robust z: (x - median) / (1.4826 MAD), with a floor
relative to the median and an absolute one per metric, so a tight metric -- or a count
that is usually zero -- does not amplify noise); each member's distance
score is the summed Euclidean distance of its normalised metric vector to every other
member's. A member is a candidate when its score is ``ratio`` times the job's median
score and one of its metrics is at least ``z_min`` robust SDs out; it is named suspect
only when it is the candidate in ``continuity`` consecutive buckets (Minder's continuity
requirement, which filters one-off jitter). Positions are taken relative to each member's
own recent position among its peers, so a GPU that always runs 3 C warmer is not a
suspect -- the one that *drifts* is. Job-wide changes (an evaluation phase, a
slower data loader) move every member alike and so never make a suspect.

:class:`JobStragglers` runs it live (inside the collector, on every job with at least
``min_ranks`` ranks reporting a pace): each rank's pace (its recent compute time per step
when the hook reports ``compute_seconds``, else its step time: in synchronous data
parallelism every rank's wall step time is equal, the fast ranks waiting in the
all-reduce) is compared across ALL ranks of the job, whatever node they run on. A rank
named suspect becomes one straggler finding, explained by the hardware signals of its GPU
against its peers' GPUs (:func:`explain`): clock-event reasons (thermal slowdown, power
capping or brake), temperature, SM clock, power draw, PCIe replays and link
width/generation, NVLink errors.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from forewarn.gpu import POWER_BITS, THERMAL_BITS
from forewarn.wire import Finding, GpuSample, Health, RankSummary, Subject, SuggestedAction

__all__ = ["Cause", "JobStragglers", "PeerComparison", "explain"]


class PeerComparison:
    """Minder-style peer comparison over a long table ``job, member, time, <metrics>``."""

    name = "models.peer_comparison"

    def __init__(self, metrics: Sequence[str], *, bucket_s: float = 5.0, ratio: float = 2.0,
                 z_min: float = 5.0, continuity: int = 3, rel_floor: float = 0.01,
                 abs_floor: dict[str, float] | None = None, baseline_buckets: int = 60
                 ) -> None:
        self.metrics = tuple(metrics)
        self.bucket_s = bucket_s
        self.ratio = ratio
        self.z_min = z_min
        self.continuity = continuity
        self.rel_floor = rel_floor
        self.baseline_buckets = baseline_buckets
        self.abs_floor = np.array([(abs_floor or {}).get(m, 1e-9) for m in self.metrics])

    def scores(self, table: pd.DataFrame) -> pd.DataFrame:
        """Per job and bucket: the top member, its score ratio, its worst |z|, and
        whether it is a candidate. Columns ``job, time, member, ratio, zmax, candidate``."""
        out = []
        bucket = np.floor(table["time"].to_numpy(np.float64) / self.bucket_s).astype(np.int64)
        member = table["member"].to_numpy()
        vals = table[list(self.metrics)].to_numpy(np.float64)
        job_codes, jobs = pd.factorize(table["job"])  # jobs in order of appearance
        order = np.argsort(job_codes, kind="stable")
        bounds = np.searchsorted(job_codes[order], np.arange(len(jobs) + 1))
        for j, job in enumerate(jobs):
            rows_of = order[bounds[j]:bounds[j + 1]]
            buckets, members, x = self._cube(bucket[rows_of], member[rows_of], vals[rows_of])
            if not len(buckets):
                continue
            med = np.nanmedian(x, axis=1, keepdims=True)
            mad = np.nanmedian(np.abs(x - med), axis=1, keepdims=True)
            scale = np.maximum(np.maximum(1.4826 * mad, self.rel_floor * np.abs(med)),
                               self.abs_floor)
            z = np.nan_to_num((x - med) / scale)
            z = z - self._own_baseline(z)
            # Summed Euclidean distance of each member to all others: (B, N).
            dist = np.sqrt(((z[:, :, None, :] - z[:, None, :, :]) ** 2).sum(-1)).sum(-1)
            top = np.argmax(dist, axis=1)
            rows = np.arange(len(buckets))
            ratio = dist[rows, top] / np.maximum(np.median(dist, axis=1), 1e-9)
            zmax = np.abs(z[rows, top, :]).max(axis=1)
            out.append(pd.DataFrame({
                "job": job, "time": (buckets + 1) * self.bucket_s,
                "member": np.asarray(members)[top], "ratio": ratio, "zmax": zmax,
                "candidate": (ratio >= self.ratio) & (zmax >= self.z_min),
            }))
        if not out:
            return pd.DataFrame(columns=["job", "time", "member", "ratio", "zmax", "candidate"])
        return pd.concat(out, ignore_index=True)

    @staticmethod
    def _cube(bucket: np.ndarray, member: np.ndarray, vals: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sorted buckets, sorted members and the mean of each metric per bucket and member
        (NaN where a member has no value in a bucket) of one job's rows. Built with numpy: a
        pandas pivot_table per job cost ~40 ms, too much to run every bucket on a fleet."""
        keep = ~np.isnan(vals).all(axis=1)
        bucket, member, vals = bucket[keep], member[keep], vals[keep]
        buckets, b_codes = np.unique(bucket, return_inverse=True)
        m_codes, members = pd.factorize(member, sort=True)
        ok = ~np.isnan(vals)
        shape = (len(buckets), len(members), vals.shape[1])
        sums, counts = np.zeros(shape), np.zeros(shape)
        np.add.at(sums, (b_codes, m_codes), np.where(ok, vals, 0.0))
        np.add.at(counts, (b_codes, m_codes), ok)
        with np.errstate(invalid="ignore", divide="ignore"):
            x = sums / counts
        return np.asarray(buckets), np.asarray(members), x

    def _own_baseline(self, z: np.ndarray) -> np.ndarray:
        """Each member's usual position among its peers: the median of its z over the
        previous ``baseline_buckets`` buckets, skipping the most recent ones so that a
        fresh drift is not absorbed. GPU-to-GPU offsets that never change are not drift."""
        if self.baseline_buckets <= 0:
            return np.zeros_like(z)
        b, n, m = z.shape
        flat = pd.DataFrame(z.reshape(b, n * m))
        base = flat.shift(self.continuity + 2).rolling(self.baseline_buckets, min_periods=1)
        out: np.ndarray = base.median().fillna(0.0).to_numpy().reshape(b, n, m)
        return out

    def suspects(self, table: pd.DataFrame) -> pd.DataFrame:
        """Buckets where a member has been the candidate ``continuity`` times in a row:
        columns ``job, time, member, ratio, zmax`` (first such time per run)."""
        s = self.scores(table)
        if s.empty:
            return s.drop(columns="candidate")
        s = s.sort_values(["job", "time"], kind="stable")
        cand_member = s["member"].where(s["candidate"])
        run_break = (cand_member != cand_member.groupby(s["job"]).shift()) | ~s["candidate"]
        run_id = run_break.cumsum()
        run_len = s.groupby(run_id).cumcount() + 1
        hit = s["candidate"] & (run_len == self.continuity)
        return s.loc[hit].drop(columns="candidate").reset_index(drop=True)

    def findings(self, table: pd.DataFrame, now: float, kind: str = "rank") -> list[Finding]:
        """Findings for members named suspect in the table (``kind``: rank or gpu;
        a gpu member is ``node/gpu``)."""
        out = []
        for row in self.suspects(table).itertuples(index=False):
            member = str(row.member)
            if kind == "gpu":
                node, _, gpu = member.rpartition("/")
                subject = Subject(kind="gpu", node=node, gpu=int(gpu), job=str(row.job))
            else:
                subject = Subject(kind="rank", job=str(row.job), rank=int(member))
            out.append(Finding(
                check=self.name, health=Health.DEGRADED, subject=subject,
                reason=(f"{kind} {member} drifts from its {row.job} peers: distance "
                        f"{row.ratio:.1f}x the median, worst metric {row.zmax:.1f} robust SDs"
                        f", {self.continuity} buckets in a row"),
                action=SuggestedAction.INSPECT_HARDWARE,
                evidence={"ratio": round(float(row.ratio), 2), "zmax": round(float(row.zmax), 2),
                          "at": float(row.time)},
                time=now,
            ))
        return out


@dataclasses.dataclass(frozen=True)
class Cause:
    """One hardware signal that sets a GPU apart from its peers."""

    kind: str
    """``thermal``, ``power``, ``clocks``, ``pcie`` or ``nvlink``."""
    text: str


def _median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _share(samples: Sequence[GpuSample], bits: int) -> float:
    known = [s for s in samples if s.throttle_reasons is not None]
    return sum(bool((s.throttle_reasons or 0) & bits) for s in known) / len(known) if known else 0.0


def _increase(samples: Sequence[GpuSample], get: Callable[[GpuSample], int | None]) -> int:
    """Increase of a cumulative counter over ``samples`` (a reset counts from zero)."""
    total, prev = 0, None
    for s in samples:
        v = get(s)
        if v is None:
            continue
        if prev is not None:
            total += v - prev if v >= prev else v
        prev = v
    return total


def _nvlink_errors(s: GpuSample) -> int | None:
    if not s.nvlink:
        return None
    return sum((lk.crc_flit or 0) + (lk.crc_data or 0) + (lk.replay or 0) + (lk.recovery or 0)
               for lk in s.nvlink)


def explain(mine: Sequence[GpuSample], peers: Sequence[Sequence[GpuSample]]) -> list[Cause]:
    """The hardware signals of a GPU (its recent samples, oldest first) that its peers'
    GPUs do not share. Thresholds: clock-event reasons in at least half the samples (and
    at least twice as often as the peers' median); 10 C above the peers' median; SM clock
    below 85 % of theirs; PCIe replays or NVLink errors growing while the peers' do not;
    the PCIe link trained below its width or generation."""
    if not mine:
        return []
    last = mine[-1]
    out: list[Cause] = []
    for kind, bits, what in (("thermal", THERMAL_BITS, "thermal slowdown"),
                             ("power", POWER_BITS, "power capping or brake")):
        share = _share(mine, bits)
        theirs = _median(_share(p, bits) for p in peers) or 0.0
        if share >= 0.5 and share >= 2 * theirs:
            out.append(Cause(kind, f"{what} in {share:.0%} of samples (peers {theirs:.0%}), "
                                   f"clock-event reasons 0x{last.throttle_reasons or 0:x}"))
    temp = _median(s.temperature_c for s in mine)
    peer_temp = _median(_median(s.temperature_c for s in p) for p in peers)
    if temp is not None and peer_temp is not None and temp >= peer_temp + 10:
        text = f"{temp:.0f} C against the peers' {peer_temp:.0f} C"
        thermal = next((c for c in out if c.kind == "thermal"), None)
        if thermal is not None:
            out[out.index(thermal)] = Cause("thermal", f"{thermal.text}; {text}")
        else:
            out.append(Cause("thermal", f"running hot: {text}"))
    clock = _median(s.sm_clock_mhz for s in mine)
    peer_clock = _median(_median(s.sm_clock_mhz for s in p) for p in peers)
    if clock is not None and peer_clock and clock < 0.85 * peer_clock:
        out.append(Cause("clocks", f"SM clock {clock:.0f} MHz against the peers' "
                                   f"{peer_clock:.0f} MHz"))
    power = _median(s.power_w for s in mine)
    limit = last.power_limit_w
    if (power is not None and limit and power >= 0.98 * limit
            and not any(c.kind == "power" for c in out)):
        out.append(Cause("power", f"drawing {power:.0f} W of its {limit:.0f} W limit"))
    for kind, get, what in (("pcie", lambda s: s.pcie_replay_total, "PCIe replays"),
                            ("nvlink", _nvlink_errors, "NVLink errors")):
        grew = _increase(mine, get)
        theirs_grew = _median(float(_increase(p, get)) for p in peers) or 0.0
        if grew > max(0.0, 2 * theirs_grew):
            out.append(Cause(kind, f"{what} +{grew} (peers' median +{theirs_grew:.0f})"))
    if (last.pcie_link_width is not None and last.pcie_link_width_max
            and last.pcie_link_width < last.pcie_link_width_max) or (
            last.pcie_link_gen is not None and last.pcie_link_gen_max
            and last.pcie_link_gen < last.pcie_link_gen_max):
        out.append(Cause("pcie", f"PCIe link x{last.pcie_link_width} gen {last.pcie_link_gen} "
                                 f"(max x{last.pcie_link_width_max} gen "
                                 f"{last.pcie_link_gen_max})"))
    return out


@dataclasses.dataclass
class _Rank:
    summary: RankSummary
    paces: collections.deque[tuple[float, float]]


class JobStragglers:
    """Live peer comparison of pace across all ranks of each job (see the module
    docstring). Feed :meth:`observe_rank` with every :class:`RankSummary` and
    :meth:`observe_gpu` with every GPU sample; :meth:`findings` returns one finding per
    rank newly named suspect. Not thread-safe.

    Args:
        bucket_s, continuity: the comparison's time bucket and how many buckets in a row
            make a suspect.
        window_s: pace history kept per rank: a rank's usual position among its peers is
            learned over it. GPU samples are kept only for GPUs that run a rank, and only
            for the buckets an explanation reads.
        min_ranks: ranks with a pace a job needs (a median of two tells nobody apart).
        rel_floor: the smallest spread counted, relative to the median pace: with 0.05 and
            ``z_min`` 5, a rank is a candidate from 1.25x its peers' median pace.
    """

    name = "job_straggler"

    def __init__(self, *, bucket_s: float = 5.0, continuity: int = 3, window_s: float = 600.0,
                 min_ranks: int = 3, rel_floor: float = 0.05, z_min: float = 5.0) -> None:
        self.comparison = PeerComparison(
            ["pace"], bucket_s=bucket_s, continuity=continuity, rel_floor=rel_floor,
            z_min=z_min, abs_floor={"pace": 1e-3},
            baseline_buckets=max(1, int(window_s / bucket_s)))
        self.window_s = window_s
        self.threshold = 1.0 + z_min * rel_floor
        self.keep_samples_s = (continuity + 2) * bucket_s
        self.min_ranks = min_ranks
        self._ranks: dict[tuple[str, int], _Rank] = {}
        self._gpus: dict[tuple[str, int], collections.deque[GpuSample]] = {}
        self._named: dict[tuple[str, int], float] = {}
        """(job, rank) -> time of the last suspect bucket reported (one finding per run)."""

    def observe_rank(self, r: RankSummary, now: float) -> None:
        """A rank's summary as an agent sent it at ``now`` (the agent's clock, as its GPU
        samples' times: a straggler is explained by the samples of the same buckets)."""
        pace = r.compute_seconds_p50 if r.compute_seconds_p50 is not None else r.step_seconds_p50
        key = (r.job, r.rank)
        entry = self._ranks.get(key)
        if entry is None:
            entry = self._ranks[key] = _Rank(r, collections.deque())
        entry.summary = r
        if r.gpu is not None:
            self._gpus.setdefault((r.node, r.gpu), collections.deque())
        if pace is not None and pace > 0 and r.alive and not r.phase:
            entry.paces.append((now, pace))
        while entry.paces and entry.paces[0][0] < now - self.window_s:
            entry.paces.popleft()

    def observe_gpu(self, s: GpuSample) -> None:
        """One GPU sample (its recent ones explain a straggler); ignored for a GPU that runs
        no rank known here."""
        samples = self._gpus.get((s.node, s.gpu))
        if samples is None:
            return
        samples.append(s)
        while samples and samples[0].time < s.time - self.keep_samples_s:
            samples.popleft()

    def forget(self, now: float) -> None:
        """Drop ranks and GPUs silent for the window."""
        for key in [k for k, e in self._ranks.items()
                    if not e.paces or e.paces[-1][0] < now - self.window_s]:
            del self._ranks[key]
            self._named.pop(key, None)
        used = {(e.summary.node, e.summary.gpu) for e in self._ranks.values()}
        for gkey in [k for k in self._gpus if k not in used]:
            del self._gpus[gkey]

    def findings(self, now: float) -> list[Finding]:
        """Stragglers newly named since the last call, across all nodes of each job."""
        self.forget(now)
        slow = self._slow_jobs()
        rows = [(job, rank, t, pace) for (job, rank), e in self._ranks.items()
                if job in slow for t, pace in e.paces]
        if not rows:
            return []
        table = pd.DataFrame(rows, columns=["job", "member", "time", "pace"])
        out = []
        for row in self.comparison.suspects(table).itertuples(index=False):
            key = (str(row.job), int(row.member))
            if float(row.time) <= self._named.get(key, -np.inf):
                continue
            self._named[key] = float(row.time)
            out.append(self._finding(key, float(row.ratio), float(row.time), now))
        return out

    def _slow_jobs(self) -> set[str]:
        """Jobs with ``min_ranks`` ranks of which one's recent pace is at least the
        candidate threshold (1 + ``z_min`` x ``rel_floor``) times the job's median: only
        they can name a straggler (one slower than its peers, not one that merely left its
        usual place), and only they pay for the comparison."""
        by_job: dict[str, list[float]] = {}
        for key, e in self._ranks.items():
            if e.paces:
                by_job.setdefault(key[0], []).append(self._recent_pace(key))
        out = set()
        for job, paces in by_job.items():
            median = statistics.median(paces)
            if len(paces) >= self.min_ranks and max(paces) >= self.threshold * median:
                out.add(job)
        return out

    def _recent_pace(self, key: tuple[str, int]) -> float:
        paces = self._ranks[key].paces
        cut = paces[-1][0] - self.comparison.continuity * self.comparison.bucket_s
        return float(statistics.median(p for t, p in paces if t >= cut))

    def _finding(self, key: tuple[str, int], ratio: float, until: float, now: float
                 ) -> Finding:
        job, rank = key
        me = self._ranks[key].summary
        peers = [e.summary for (j, r), e in self._ranks.items()
                 if j == job and r != rank and e.paces]
        pace = self._recent_pace(key)
        peer_pace = statistics.median(self._recent_pace((job, p.rank)) for p in peers)
        nodes = sorted({me.node, *(p.node for p in peers)})
        # what the GPUs showed while the rank was slow: the buckets that named it
        since = until - self.comparison.continuity * self.comparison.bucket_s

        def recent(node: str, gpu: int | None) -> list[GpuSample]:
            return [s for s in self._gpus.get((node, gpu), ()) if since <= s.time <= until] \
                if gpu is not None else []

        mine = recent(me.node, me.gpu)
        theirs = [got for p in peers if (p.node, p.gpu) != (me.node, me.gpu)
                  if (got := recent(p.node, p.gpu))]
        causes = explain(mine, theirs) if mine and theirs else []
        why = ("; ".join(f"{c.kind}: {c.text}" for c in causes) if causes else
               "no hardware signal of its GPU explains it (look at its host, data loading "
               "or network)" if mine else "no telemetry of its GPU to explain it")
        where = f"{me.node} GPU {me.gpu}" if me.gpu is not None else me.node
        return Finding(
            check=self.name, health=Health.DEGRADED,
            subject=Subject(kind="rank", node=me.node, gpu=me.gpu, job=job, rank=rank),
            reason=(f"rank {rank} of job {job} ({where}) is a straggler: {pace:.3g} s a step, "
                    f"{pace / peer_pace:.2f}x the median of its {len(peers)} peers on "
                    f"{len(nodes)} node(s) ({peer_pace:.3g} s): {why}"),
            action=SuggestedAction.WATCH,
            evidence={"pace_s": round(pace, 6), "peers_pace_s": round(peer_pace, 6),
                      "ratio": round(pace / peer_pace, 3), "distance_ratio": round(ratio, 2),
                      "causes": ",".join(c.kind for c in causes), "nodes": len(nodes)},
            time=now,
        )
