"""Store occupancy: what vllm-omni 0.30.0 leaves pinned in Mooncake's store, request after request.

The connector soft-pins every object (30 min by default) and its ``cleanup()`` does nothing: a request's
objects stay until the master evicts them. :func:`occupancy` sends requests one at a time into a fresh
store of a fixed size, per arm, and reads the master's metrics after each.
"""

from __future__ import annotations

import os
import statistics
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


from omni_accum.bench.mooncake_services import HOST, MooncakeServices
from omni_accum.bench.stage_host import Job, StageHost, _plan, make_connector


# ---------------------------------------------------------------------------------------------- #
# Occupancy: what vllm-omni 0.30.0 leaves pinned in the store
# ---------------------------------------------------------------------------------------------- #


def _occupancy_sender(
    *, pipes: list, extra: dict, wl: Any, arm: Any, cl: int, requests: int, tag: str, metrics_url: str | None
) -> dict[str, Any]:
    """Send ``requests`` requests one after another as 0.30.0 does (nothing removed); after each, the master's
    allocated bytes and key count."""
    from omni_accum.bench.engines import make_engine  # noqa: PLC0415

    for fd in (fd for p in pipes for fd in p):
        os.close(fd)
    ctx, streams = _plan(wl, cl, 1)
    conn = make_connector(0, extra)
    engine = make_engine(arm, ctx)
    rows = []
    objects = 0
    try:
        for q in range(requests):
            rid = f"{tag}-{q}"
            sent_bytes, failed = 0, 0
            for i, chunk in enumerate(streams[0]):
                ok, size, _ = conn.put("0", "1", f"{rid}_{i}", engine.encode(rid, chunk))
                sent_bytes += int(size) if ok else 0
                failed += 0 if ok else 1
                objects += 1 if ok else 0
            engine.release(rid)
            m = _scrape(metrics_url) if metrics_url else {}
            rows.append(
                {
                    "request": q + 1,
                    "put_bytes": sent_bytes,
                    "failed_puts": failed,
                    "objects": objects,
                    "allocated": m.get("master_allocated_bytes"),
                    "keys": m.get("master_key_count"),
                    "capacity": m.get("master_total_capacity_bytes"),
                }
            )
    finally:
        engine.close()
        conn.close()
    return {"rows": rows}


def _scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=5.0).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


@dataclass
class Occupancy:
    """One arm's run of ``requests`` requests into a fresh store of ``segment_bytes``, nothing removed."""

    arm: str
    context_len: int
    segment_bytes: int
    rows: list[dict[str, Any]]

    @property
    def put_bytes_per_request(self) -> float:
        ok = [r["put_bytes"] for r in self.rows if not r["failed_puts"]]
        return statistics.fmean(ok) if ok else 0.0

    @property
    def pinned_bytes_per_request(self) -> float | None:
        """Allocated bytes in the segment per request, over the requests before the first failed put or eviction."""
        good = []
        for r in self.rows:
            if r["failed_puts"] or r["allocated"] is None or self._evicted(r):
                break
            good.append(r)
        if not good:
            return None
        return good[-1]["allocated"] / good[-1]["request"]

    @staticmethod
    def _evicted(row: dict[str, Any]) -> bool:
        return row.get("keys") is not None and row["keys"] < row["objects"]

    @property
    def first_eviction(self) -> int | None:
        """The first request after which the master holds fewer objects than were put: it evicted soft-pinned
        objects (``allow_evict_soft_pinned_objects``, at ``eviction_high_watermark_ratio`` of the segment)."""
        return next((r["request"] for r in self.rows if self._evicted(r)), None)

    @property
    def first_failure(self) -> int | None:
        """The first request with a failed put (the segment was full), or None."""
        return next((r["request"] for r in self.rows if r["failed_puts"]), None)


def occupancy(
    host: StageHost,
    workload: Any,
    arms: Mapping[str, Any],
    *,
    context_len: int,
    requests: int,
    segment_bytes: int,
    timeout: float = 600.0,
) -> list[Occupancy]:
    """Per arm, a fresh master and holder of ``segment_bytes``, then ``requests`` requests as vllm-omni 0.30.0
    leaves them: soft-pinned, never removed."""
    from omni_accum.bench.workloads import load_workload  # noqa: PLC0415

    wl = load_workload(workload)
    out = []
    for lab, arm in arms.items():
        with MooncakeServices(segment_bytes=segment_bytes) as svc:
            url = f"http://{HOST}:{svc.metrics_port}/metrics"
            kw = {
                "extra": svc.connector_extra(),
                "wl": wl,
                "arm": arm,
                "cl": context_len,
                "requests": requests,
                "tag": f"occ{os.getpid()}-{lab}",
                "metrics_url": url,
            }
            (res,) = host.run([Job(f"{__name__}:_occupancy_sender", kw)], timeout=timeout)
        out.append(Occupancy(lab, context_len, segment_bytes, res["rows"]))
    return out


def format_occupancy(occ: list[Occupancy]) -> str:
    from omni_accum.bench.report import _fmt_bytes  # noqa: PLC0415

    rows = [
        [
            "arm",
            "put/request",
            "pinned/request",
            "requests",
            "first eviction",
            "first failed put",
            "allocated at end",
            "objects kept",
        ]
    ]
    for o in occ:
        last = o.rows[-1] if o.rows else {}
        pinned = o.pinned_bytes_per_request
        rows.append(
            [
                o.arm,
                _fmt_bytes(o.put_bytes_per_request),
                _fmt_bytes(pinned) if pinned is not None else "-",
                str(len(o.rows)),
                f"after request {o.first_eviction}" if o.first_eviction else "none",
                f"request {o.first_failure}" if o.first_failure else "none",
                f"{_fmt_bytes(last.get('allocated') or 0)} of {_fmt_bytes(o.segment_bytes)}",
                f"{int(last.get('keys') or 0)} of {last.get('objects', 0)}",
            ]
        )
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def format_store_table(store: list[Any], baseline: str = "upstream") -> str:
    """Bytes through the store per step (mean, and the median put: a decode chunk), per request (= what vllm-omni
    0.30.0 leaves pinned per request), each as a ratio to ``baseline``."""
    from omni_accum.bench.report import _fmt_bytes  # noqa: PLC0415

    base = next((s for s in store if s.arm == baseline), None)
    rows = [["arm", "store/step", "p50 put", "store/request", f"vs {baseline}", "p50 put vs", "puts", "failed puts"]]
    for s in store:
        ratio = (
            f"{s.store_bytes_per_request / base.store_bytes_per_request:.3g}x"
            if base and base.store_bytes_per_request
            else "-"
        )
        p50 = f"{s.put_bytes_p50 / base.put_bytes_p50:.3g}x" if base and base.put_bytes_p50 else "-"
        rows.append(
            [
                s.arm,
                _fmt_bytes(s.store_bytes_per_step),
                _fmt_bytes(s.put_bytes_p50),
                _fmt_bytes(s.store_bytes_per_request),
                ratio,
                p50,
                str(s.puts),
                str(s.failed_puts),
            ]
        )
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)
