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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from forewarn.wire import Finding, Health, Subject, SuggestedAction

__all__ = ["PeerComparison"]


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
        t = table.assign(bucket=np.floor(table["time"] / self.bucket_s).astype(np.int64))
        for job, g in t.groupby("job", sort=False):
            cube = g.pivot_table(index="bucket", columns="member", values=list(self.metrics),
                                 aggfunc="mean")
            buckets = cube.index.to_numpy()
            members = cube.columns.get_level_values(1).unique()
            x = np.stack([cube[m].reindex(columns=members).to_numpy() for m in self.metrics],
                         axis=2)  # (B, N, M)
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
