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
    n_blocks = np.diff(offsets)
    # Ids numbered in order of first occurrence by Arrow's hash table (4 bytes a reference, 8 per distinct id;
    # the sort this replaces held ~45 bytes a reference): a reference is its id's first occurrence when its
    # number exceeds every number before it.
    keys = np.asarray(pc.dictionary_encode(block_hashes.flatten()).indices)
    running = np.maximum.accumulate(keys)
    first = np.ones(keys.size, dtype=bool)
    first[1:] = running[1:] > running[:-1]
    del running
    row = np.repeat(np.arange(n_blocks.size, dtype=np.int32), n_blocks)
    seen_before = row[first][keys] < row  # the row of each id's first occurrence, by number, is before this one
    del keys, row, first
    # a request hits its blocks up to its first miss
    miss = np.flatnonzero(~seen_before)
    starts = offsets[:-1]
    first_miss = np.append(miss, offsets[-1])[np.searchsorted(miss, starts)]
    return np.minimum(first_miss - starts, n_blocks)


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
