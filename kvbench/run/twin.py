"""How close a twin is to its trace, measured: infinite-cache hit rate and radix-lru hit rate (replayed through
the `sim` backend) at capacities spread over the trace's footprint. kvbench/report/twin.py draws what this
measures beside the distributions the model fits."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.stats import DEFAULT_WARMUP, hit_rates, infinite_cache_hits

CURVE_POINTS = 8
POLICY = "radix-lru"


def capacities(table: pa.Table, points: int = CURVE_POINTS) -> list[int]:
    """`points` capacities (blocks), evenly spaced on a log scale from 1% to 100% of the trace's distinct blocks:
    from a cache that holds little more than the hottest prefixes to one that holds everything."""
    flat = pc.list_flatten(table.column("block_hashes"))
    unique = max(int(pc.count_distinct(flat).as_py()) if len(flat) else 1, 1)
    caps = np.unique(np.maximum(np.round(np.geomspace(unique / 100, unique, points)), 1).astype(int))
    return [int(c) for c in caps]


def infinite(table: pa.Table, block_size: int, warmup: float = DEFAULT_WARMUP) -> dict:
    """Token hit rate of an unbounded cache (all requests and after the warm-up share)."""
    hashes = table.column("block_hashes")
    nb = pc.list_value_length(hashes).to_numpy(zero_copy_only=False).astype(np.int64)
    inp = table.column("input_tokens").to_numpy().astype(np.int64)
    return hit_rates(infinite_cache_hits(hashes), nb, inp, block_size, warmup)["token"]


def curve(trace_path: Path, caps: list[int], warmup: float = DEFAULT_WARMUP) -> list[dict]:
    """radix-lru token hit rates at `caps` (blocks) from the `sim` backend."""
    from kvbench.run.runner import run_replay  # the runner pulls in the cache kernels: only when measuring

    with tempfile.TemporaryDirectory(prefix="kvbench-fit-") as tmp:
        _, summary = run_replay(
            trace_path,
            "sim",
            {"policy": POLICY, "capacity": ",".join(map(str, caps))},
            out=Path(tmp) / "run",
            warmup=warmup,
            report=False,
        )
    points = [p for p in summary["points"] if p["policy"] == POLICY]
    return [{"capacity_blocks": p["capacity_blocks"], **p["hit_rate"]["token"]} for p in points]


def fidelity(orig: pa.Table, orig_path: Path, twin: pa.Table, twin_path: Path, block_size: int, scale: float = 1.0):
    """Original vs twin. A K-times twin is compared at K times each capacity: the same cache per user."""
    caps = capacities(orig)
    o_inf, t_inf = infinite(orig, block_size), infinite(twin, block_size)
    o_curve = curve(orig_path, caps)
    t_curve = curve(twin_path, [max(1, int(round(c * scale))) for c in caps])
    rows = []
    for o, t in zip(o_curve, t_curve, strict=True):
        rows.append(
            {
                "capacity_blocks": o["capacity_blocks"],
                "twin_capacity_blocks": t["capacity_blocks"],
                "original": {"steady": o["steady"], "all": o["all"]},
                "twin": {"steady": t["steady"], "all": t["all"]},
            }
        )

    def gap(a, b, key):
        return abs(a[key] - b[key])

    return {
        "scale": scale,
        "infinite_cache": {"original": o_inf, "twin": t_inf, "gap_steady": gap(o_inf, t_inf, "steady")},
        "infinite_cache_gap_all": gap(o_inf, t_inf, "all"),
        "curve": rows,
        "max_curve_gap_steady": max((gap(r["original"], r["twin"], "steady") for r in rows), default=0.0),
        "max_curve_gap_all": max((gap(r["original"], r["twin"], "all") for r in rows), default=0.0),
    }
