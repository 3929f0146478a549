"""Trace characterisation (`kvbench trace info`): sizes, rates, lengths, reuse and the infinite-cache bound."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DEFAULT_WARMUP = 0.5  # fraction of requests treated as warm-up (kvcache.ai convention, DESIGN.md section 7)
PERCENTILES = (50, 90, 99)


def infinite_cache_hits(block_hashes: pa.ChunkedArray | pa.ListArray) -> np.ndarray:
    """Hit blocks per request with an unbounded cache under the prefix rule.

    A block hits when an earlier request already had it, and only while every earlier block of the same
    prompt hit too (prefix rule, DESIGN.md section 7).
    """
    if isinstance(block_hashes, pa.ChunkedArray):
        block_hashes = block_hashes.combine_chunks()
    offsets = np.asarray(block_hashes.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    flat = np.asarray(block_hashes.flatten())
    n_blocks = np.diff(offsets)
    row = np.repeat(np.arange(n_blocks.size), n_blocks)
    # First row in which each id occurs: stable sort keeps positions ascending within equal ids.
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    group_start = np.ones(flat.size, dtype=bool)
    group_start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    first_pos_sorted = np.maximum.accumulate(np.where(group_start, np.arange(flat.size), 0))
    first_row = np.empty(flat.size, dtype=np.int64)
    first_row[order] = row[order[first_pos_sorted]]
    seen_before = first_row < row

    pos_in_row = np.arange(flat.size) - np.repeat(offsets[:-1], n_blocks)
    first_miss = np.where(seen_before, np.iinfo(np.int64).max, pos_in_row)
    hits = np.zeros(n_blocks.size, dtype=np.int64)
    nonempty = n_blocks > 0
    if flat.size:
        hits[nonempty] = np.minimum.reduceat(first_miss, offsets[:-1][nonempty])
    return np.minimum(hits, n_blocks)


def hit_rates(
    hit_blocks: np.ndarray,
    n_blocks: np.ndarray,
    input_tokens: np.ndarray,
    block_size: int,
    warmup: float = DEFAULT_WARMUP,
    hit_tokens: np.ndarray | None = None,
) -> dict:
    """Token and block hit rates over all requests and over the steady state (after the warm-up share).
    `hit_tokens` defaults to whole hit blocks, capped by the prompt."""
    if hit_tokens is None:
        hit_tokens = np.minimum(hit_blocks * block_size, input_tokens)
    start = int(len(input_tokens) * warmup)

    def ratio(num, den):
        den = float(den.sum())
        return float(num.sum()) / den if den else 0.0

    return {
        "token": {"all": ratio(hit_tokens, input_tokens), "steady": ratio(hit_tokens[start:], input_tokens[start:])},
        "block": {"all": ratio(hit_blocks, n_blocks), "steady": ratio(hit_blocks[start:], n_blocks[start:])},
        "warmup": warmup,
    }


def _dist(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}, "max": 0.0}
    pct = np.percentile(values, PERCENTILES)
    return {
        "mean": float(values.mean()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)},
        "max": float(values.max()),
    }


def _breakdown(frame, key: str) -> list[dict]:
    import polars as pl  # loaded on use: the CLI starts faster without it

    if frame[key].null_count() == frame.height:
        return []
    total_tokens = frame["input_tokens"].sum()
    grouped = (
        frame.group_by(key)
        .agg(
            pl.len().alias("requests"),
            pl.col("input_tokens").sum().alias("input_tokens"),
            pl.col("input_tokens").mean().alias("mean_input"),
            pl.col("output_tokens").mean().alias("mean_output"),
            pl.col("hit_tokens").sum().alias("hit_tokens"),
        )
        .with_columns(
            (pl.col("input_tokens") / total_tokens).alias("token_share"),
            (pl.col("hit_tokens") / pl.col("input_tokens")).alias("infinite_cache_token_hit_rate"),
        )
        .sort("requests", descending=True)
    )
    return [
        {k: (v if k != key else (v if v is not None else "(none)")) for k, v in row.items()}
        for row in grouped.to_dicts()
    ]


def trace_info(table: pa.Table, block_size: int, warmup: float = DEFAULT_WARMUP) -> dict:
    """Everything `kvbench trace info` prints, as a JSON-ready dict with stable keys (whole table in memory)."""
    hashes = table.column("block_hashes")
    n_blocks = pc.list_value_length(hashes).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(hashes)
    unique_blocks = int(pc.count_distinct(flat).as_py()) if len(flat) else 0
    people = {"sessions": _distinct(table, "session_id"), "users": _distinct(table, "user_id")}
    return _summarize(table, block_size, warmup, infinite_cache_hits(hashes), n_blocks, unique_blocks, people)


def _distinct(table: pa.Table, name: str) -> int:
    col = table.column(name)
    col = col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col
    return int(pc.count_distinct(col).as_py()) if col.null_count < table.num_rows else 0


def trace_info_file(path, warmup: float = DEFAULT_WARMUP, tmpdir=None) -> dict:
    """Validate the trace at `path` and return its `trace_info`, in bounded memory: the block ids are read
    row group by row group (`tracescan.scan_trace`; the infinite-cache bound spills to `tmpdir`), and only
    the per-request columns are held (tens of bytes a request). Raises ValidationFailed."""
    import polars as pl

    from .traceio import iter_batches
    from .tracescan import scan_trace

    scanned = scan_trace(path, tmpdir=tmpdir, warmup=warmup, keep_requests=True)
    # distinct sessions and users by 64-bit hash, chunk by chunk: the ids themselves are not kept
    present = [c for c in ("session_id", "user_id") if c in read_meta_columns(path)]
    hashed = {c: [] for c in present}
    for batch in iter_batches(path, columns=present):
        for c in present:
            ids = pl.from_arrow(batch.column(c)).drop_nulls()
            hashed[c].append(np.unique(ids.hash(seed=0).to_numpy()))
    counts = {c: int(np.unique(np.concatenate(hashed[c])).size) if hashed[c] else 0 for c in present}
    return _summarize(
        scanned.requests,
        scanned.meta.block_size,
        warmup,
        scanned.infinite_hits,
        scanned.n_blocks,
        scanned.unique_blocks,
        {"sessions": counts.get("session_id", 0), "users": counts.get("user_id", 0)},
    )


def read_meta_columns(path) -> list[str]:
    from .traceio import _open

    return _open(path).schema_arrow.names


def _summarize(
    table: pa.Table,
    block_size: int,
    warmup: float,
    hits: np.ndarray,
    n_blocks: np.ndarray,
    unique_blocks: int,
    people: dict[str, int],
) -> dict:
    """The trace info dict from the per-request columns plus the block statistics, however computed."""
    import polars as pl

    n = table.num_rows
    arrival = table.column("arrival_s").to_numpy()
    inp = table.column("input_tokens").to_numpy().astype(np.int64)
    out = table.column("output_tokens").to_numpy().astype(np.int64)
    duration = float(arrival[-1] - arrival[0]) if n else 0.0

    def text_col(name):
        col = table.column(name)
        return col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col

    def text_series(name):
        # Arrow to polars directly: to_pylist() built one Python str per request (slow on millions of rows).
        return pl.from_arrow(text_col(name)).cast(pl.Utf8).alias(name)

    frame = pl.DataFrame(
        {
            "workload": text_series("workload"),
            "tenant": text_series("tenant"),
            "input_tokens": inp,
            "output_tokens": out,
            "hit_tokens": np.minimum(hits * block_size, inp),
        }
    )

    return {
        "requests": n,
        "block_size": block_size,
        "duration_s": duration,
        "rates": {
            "requests_per_s": n / duration if duration > 0 else None,
            "input_tokens_per_s": float(inp.sum()) / duration if duration > 0 else None,
            "output_tokens_per_s": float(out.sum()) / duration if duration > 0 else None,
        },
        "input_tokens": {"total": int(inp.sum()), **_dist(inp)},
        "output_tokens": {"total": int(out.sum()), **_dist(out)},
        "blocks": {"references": int(n_blocks.sum()), "unique": unique_blocks},
        **people,
        "tenants": _distinct(table, "tenant"),
        "infinite_cache_hit_rate": hit_rates(hits, n_blocks, inp, block_size, warmup),
        "by_workload": _breakdown(frame, "workload"),
        "by_tenant": _breakdown(frame, "tenant"),
    }
