"""Trace characterisation (`kvbench trace info`): sizes, rates, lengths, reuse and the infinite-cache bound."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DEFAULT_WARMUP = 0.5  # fraction of requests treated as warm-up (kvcache.ai convention, docs/semantics.md, Hit rates)


def infinite_cache_hits(block_hashes: pa.ChunkedArray | pa.ListArray) -> np.ndarray:
    """Hit blocks per request with an unbounded cache under the prefix rule.

    A block hits when an earlier request already had it, and only while every earlier block of the same
    prompt hit too (prefix rule, docs/semantics.md, Hit rates).
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


def trace_info(table: pa.Table, block_size: int, warmup: float = DEFAULT_WARMUP) -> dict:
    """Everything `kvbench trace info` prints, as a JSON-ready dict with stable keys (whole table in memory)."""
    from kvbench.trace.summary import TraceSummary

    hashes = table.column("block_hashes")
    n_blocks = pc.list_value_length(hashes).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(hashes)
    unique_blocks = int(pc.count_distinct(flat).as_py()) if len(flat) else 0
    summary = TraceSummary(table.num_rows, block_size, warmup)
    summary.add(table, infinite_cache_hits(hashes), n_blocks)
    return summary.result(unique_blocks)


def trace_info_file(path, warmup: float = DEFAULT_WARMUP, tmpdir=None, chunk_rows: int | None = None) -> dict:
    """Validate the trace at `path` and return its `trace_info`, in bounded memory, reading it twice by row
    group: `scan.scan_trace` validates it and resolves the infinite cache out of core (spilled to
    `tmpdir`), keeping its hit blocks per request (4 bytes a request); a second pass reads the light
    per-request columns (no block ids) into `summary.TraceSummary`. Raises ValidationFailed."""
    from kvbench.trace.files import ROW_GROUP_SIZE, _open, iter_batches
    from kvbench.trace.scan import scan_trace
    from kvbench.trace.summary import COLUMNS, TraceSummary

    chunk_rows = chunk_rows or ROW_GROUP_SIZE
    scanned = scan_trace(path, tmpdir=tmpdir, warmup=warmup, keep_hits=True, chunk_rows=chunk_rows)
    block_size, hits = scanned.meta.block_size, scanned.infinite_hits
    summary = TraceSummary(scanned.n_requests, block_size, warmup)
    present = [c for c in COLUMNS if c in _open(path).schema_arrow.names]
    start = 0
    for batch in iter_batches(path, columns=present, batch_size=chunk_rows):
        stop = start + batch.num_rows
        inp = batch.column("input_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        n_blocks = -(-inp // block_size)  # validated: a request has ceil(input_tokens / block_size) blocks
        summary.add(batch, hits[start:stop], n_blocks)
        start = stop
    return summary.result(scanned.unique_blocks)
