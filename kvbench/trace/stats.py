"""Trace characterisation (`kvbench trace info`): sizes, rates, lengths, reuse and the infinite-cache bound, of a
trace in memory; `scan.trace_info_file` gives the same numbers for a file, in bounded memory."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbench.trace.summary import TraceSummary

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
    hashes = table.column("block_hashes")
    n_blocks = pc.list_value_length(hashes).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(hashes)
    unique_blocks = int(pc.count_distinct(flat).as_py()) if len(flat) else 0
    summary = TraceSummary(table.num_rows, block_size, warmup)
    summary.add(table, infinite_cache_hits(hashes), n_blocks)
    return summary.result(unique_blocks)
