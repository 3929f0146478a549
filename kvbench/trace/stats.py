"""Trace characterisation (`kvbench trace info`): sizes, rates, lengths, reuse and the infinite-cache bound, of a
trace in memory; `scan.trace_info_file` gives the same numbers for a file, in bounded memory."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from kvbench.trace.compute import pc
from kvbench.trace.summary import TraceSummary

_SLICE_ROWS = 16384  # rows of the trace per step of infinite_cache_hits (~1M block references of chat)
DEFAULT_WARMUP = 0.5  # fraction of requests treated as warm-up (kvcache.ai convention, docs/semantics.md, Hit rates)


def infinite_cache_hits(block_hashes: pa.ChunkedArray | pa.ListArray, number=None) -> np.ndarray:
    """Hit blocks per request with an unbounded cache under the prefix rule.

    A block hits when an earlier request already had it, and only while every earlier block of the same
    prompt hit too (prefix rule, docs/semantics.md, Hit rates). `number(chunks)` yields each chunk's block ids
    numbered by first appearance across the chunks (int32); by default Arrow's hash table
    (`arrow_numbers`), which the replay runner swaps for the cache model's leaner one.
    """
    chunks = block_hashes.chunks if isinstance(block_hashes, pa.ChunkedArray) else [block_hashes]
    chunks = [c for c in chunks if len(c)]
    if not chunks:
        return np.zeros(0, dtype=np.int64)
    # A reference is its id's first occurrence when its number exceeds every number before it. Done a slice
    # of rows at a time, in memory bounded by the slice (docs/architecture.md, Memory).
    first_row = np.empty(0, np.int32)  # row of each id's first occurrence
    numbered = 0  # ids numbered before the slice
    out, row0 = [], 0
    for chunk, all_keys in zip(chunks, (number or arrow_numbers)(chunks)):
        offsets = np.asarray(chunk.offsets, dtype=np.int64)
        for lo in range(0, len(chunk), _SLICE_ROWS):
            hi = min(lo + _SLICE_ROWS, len(chunk))
            n_blocks = np.diff(offsets[lo : hi + 1])
            keys = all_keys[offsets[lo] - offsets[0] : offsets[hi] - offsets[0]]
            row = np.repeat(np.arange(row0 + lo, row0 + hi, dtype=np.int32), n_blocks)
            # the largest number so far, the slices before included
            running = np.maximum(np.maximum.accumulate(keys), numbered - 1) if keys.size else keys
            first = np.empty(keys.size, dtype=bool)
            first[:1] = keys[:1] >= numbered
            first[1:] = running[1:] > running[:-1]
            numbered = int(running[-1]) + 1 if keys.size else numbered
            if numbered > first_row.size:  # grown geometrically; np.empty pages are resident only once written
                grown = np.empty(max(numbered, 2 * first_row.size), np.int32)
                grown[: first_row.size] = first_row
                first_row = grown
            first_row[keys[first]] = row[first]
            seen_before = first_row[keys] < row
            del running, first, row
            # a request hits its blocks up to its first miss
            starts = np.concatenate([[0], np.cumsum(n_blocks)])
            miss = np.flatnonzero(~seen_before)
            first_miss = np.append(miss, starts[-1])[np.searchsorted(miss, starts[:-1])]
            out.append(np.minimum(first_miss - starts[:-1], n_blocks))
        row0 += len(chunk)
    return np.concatenate(out)


def arrow_numbers(chunks: list[pa.ListArray]) -> Iterator[np.ndarray]:
    """Block ids of each chunk numbered by first appearance across the chunks, with Arrow's hash table (one
    table for all chunks: 4 bytes a reference, and ~80 bytes a distinct id while it runs)."""
    flats = [pc.list_flatten(c) for c in chunks]
    with_refs = [f for f in flats if len(f)]  # (Arrow leaves empty chunks out of the encoding)
    encoded = iter(pc.dictionary_encode(pa.chunked_array(with_refs, pa.uint64())).chunks if with_refs else ())
    pa.default_memory_pool().release_unused()  # the hash table, which Arrow's allocator would keep
    for flat in flats:
        yield np.asarray(next(encoded).indices) if len(flat) else np.empty(0, np.int32)


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
