"""What several chaos scenarios share: rounding figures, waiting for the main collector's
first finding, settling and accounting a telemetry rig, and posting a client's own
batches to a rig's collector (see :mod:`forewarn.chaos.scenarios`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forewarn.chaos.accounting import Account, account
from forewarn.chaos.lab import Lab
from forewarn.chaos.outcome import Outcome
from forewarn.chaos.telemetry_rig import TelemetryRig
from forewarn.spawn.procs import wait_until


def rounded(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def first_finding(lab: Lab, node: str, check: str, since: float, timeout: float,
                   match: Callable[[dict[str, Any]], bool] = lambda f: True,
                   health: tuple[str, ...] = ("unhealthy", "degraded")
                   ) -> dict[str, Any] | None:
    """The collector's first stored ``check`` finding on ``node`` at or after ``since``
    with one of ``health`` that ``match`` accepts (the finding body, with its row time)."""
    c = lab.main_collector()

    def look() -> dict[str, Any] | None:
        for row in c.findings(node, check, since):
            f = row.get("finding") or {}
            if f.get("health") in health and match(f):
                return dict(f)
        return None

    got: dict[str, Any] | None = wait_until(look, timeout, step=0.2)
    return got


# A scenario's own client posts what a broken or hostile agent would, with a token of its
# own node on the rig's collector, beside the rig's real agent.

def settle(rig: TelemetryRig, out: Outcome, what: str, timeout: float = 60.0) -> float | None:
    """Wait until the agent's spool is empty; returns how long that took."""
    t0 = time.time()
    ok = wait_until(rig.spool_empty, timeout, step=0.1)
    out.expect(ok is not None, f"the spool did not drain {what}")
    return rounded(time.time() - t0) if ok else None


def more_batches(rig: TelemetryRig, timeout: float = 30.0, n: int = 4) -> None:
    """Wait (at most ``timeout``) until the rig's collector stored ``n`` more batches
    than now: the agent runs normally again before it is accounted."""
    rig.storing(rig.stored_batches() + n, timeout)


def _stored_settles(rig: TelemetryRig, still_s: float = 3.0, timeout: float = 30.0) -> None:
    """Wait until the collector's stored batch count holds still for ``still_s`` (at most
    ``timeout``): the agent's last batch, sent as it stopped, may still be on its way
    (through the bus: durable in the stream, not yet consumed) when the collector is
    killed, which would count a delivered batch as lost."""
    last, since, end = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            n = rig.stored_batches()
        except OSError:
            return
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= still_s:
            return
        time.sleep(0.25)


def finish_telemetry(lab: Lab, rig: TelemetryRig, out: Outcome,
                      excused: list[tuple[float, float]], expect_drops: bool = False
                      ) -> Account:
    o = lab.options
    dropped = rig.agent.metric("forewarn_uplink_dropped_batches_total") or 0.0
    rig.agent.stop()  # gracefully: it seals what it holds and sends it
    _stored_settles(rig)
    # kill -9, not SIGTERM: what the collector acknowledged must be durable without a
    # graceful stop (that is what is being checked).
    rig.collector.kill9()
    acc = account(rig.agent.spool, rig.collector.data, node=rig.node,
                  allowed_gap_s=3 * o.telemetry_interval_s + 0.5, excused=excused)
    out.figures.update(acc.as_dict())
    out.figures.pop("excused_gaps")
    out.figures["gaps"] = len(acc.gaps)
    out.figures["dropped_counted"] = int(dropped)
    out.expect(acc.samples_in_batches == acc.samples_stored,
               f"{acc.samples_in_batches} samples in stored batches, {acc.samples_stored} in "
               "the telemetry history")
    out.expect(acc.duplicate_samples == 0, f"{acc.duplicate_samples} samples stored twice")
    out.expect(acc.spooled_left == 0, f"{acc.spooled_left} batches left in the spool")
    if expect_drops:
        out.expect(acc.lost_batches == int(dropped),
                   f"{acc.lost_batches} batches missing but {int(dropped)} counted as dropped")
        miss = acc.missing_seqs
        out.expect(not miss or miss == list(range(miss[0], miss[-1] + 1)),
                   "dropped batches are not one run of the oldest: "
                   f"{acc.as_dict()['missing_seqs']}")
        out.expect(not miss or miss[-1] < acc.produced_batches - 1,
                   "the newest batches were not kept")
        out.expect(not acc.gaps, f"sample gaps outside the overflow: {acc.gaps[:3]}")
        out.expect(dropped > 0, "the spool never overflowed (bound too large for the cut?)")
        out.lost = (f"{acc.lost_batches} of {acc.produced_batches} batches, every one "
                    f"counted in forewarn_uplink_dropped_batches_total")
    else:
        out.expect(acc.lost_batches == 0, f"batches lost: {acc.as_dict()['missing_seqs']}")
        out.expect(not acc.gaps, f"sample gaps over {3 * o.telemetry_interval_s + 0.5:.1f} s: "
                   f"{acc.gaps[:3]}")
        out.lost = (f"nothing: {acc.stored_batches}/{acc.produced_batches} batches, "
                    f"{acc.samples_stored} samples, each stored once")
    return acc


def post_batch(rig: TelemetryRig, node: str, batch: dict[str, Any],
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST ``batch`` (msgpack) to the rig's collector as ``node``; (status, body)."""
    import httpx
    import msgspec

    h = {"content-type": "application/msgpack",
         "authorization": f"Bearer {rig.token(node)}", **(headers or {})}
    r = httpx.post(rig.collector.url + "/api/v1/ingest", content=msgspec.msgpack.encode(batch),
                   headers=h, timeout=10)
    return r.status_code, r.text


def sample_record(node: str, gpu: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"node": node, "gpu": gpu, "time": t, "source": "sim", "simulated": True,
            "temperature_c": 60.0, "power_w": 300.0, "ecc_corrected_volatile": 1, **fields}


def batch_record(node: str, agent_id: str, seq: int, samples: list[dict[str, Any]],
           created: float | None = None, **more: Any) -> dict[str, Any]:
    return {"node": node, "agent_id": agent_id, "seq": seq,
            "created": time.time() if created is None else created, "samples": samples,
            **more}


def parquet_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.parquet") if p.is_file())


def new_parquet(rig: TelemetryRig, since: float, timeout: float = 30.0) -> bool:
    """A Parquet file written after ``since`` appears in the collector's data dir."""
    def fresh() -> bool:
        return any(p.stat().st_mtime > since for p in parquet_files(rig.collector.data))
    return wait_until(fresh, timeout, step=0.2) is not None

